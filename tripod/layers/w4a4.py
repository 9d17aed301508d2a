"""NVFP4 W4A4 linears (compressed-tensors ``nvfp4-pack-quantized`` with FP4 input activations, as
``llmcompressor``'s ``NVFP4`` scheme writes them): FP4 E2M1 weights with an FP8 E4M3 scale per 16
inputs over a float32 global scale, and input activations quantized the same way on the fly — an
E4M3 scale per 16 inputs of each row, computed from the row, over the checkpoint's static
``input_global_scale``.

Activation quantization is compressed-tensors' own (``compute_dynamic_scales_and_zp`` →
``calculate_qparams``, then ``_quantize``; strategy ``tensor_group``, ``dynamic: local``), step by
step in the same dtypes: per group of 16 inputs, ``amax = max|x|`` and ``s = amax / 6`` in the
activations' dtype; ``s = global · s`` in float32; ``s`` rounded to E4M3 (clamped to ±448; a zero
scale becomes E4M3's eps, 0.125); the effective scale ``e = s / global`` (float32); ``x / e`` in
float32, clamped to ±6 and rounded to the nearest E2M1 value (ties as compressed-tensors rounds them:
0.25 → 0, 0.75 → 1, 1.25 → 1, 1.75 → 2, 2.5 → 2, 3.5 → 4, 5 → 4).

The product is formed from the exact FP4 values. Every E2M1 value is an integer over 2, so the codes
are held as ``c = 2 · fp4`` (int8, ``|c| ≤ 12``); per group ``P = Σ_{k∈g} c_x · c_w`` is an integer
below 16 · 144 = 2304, exact in float32 whatever the summation order. Then, in float64 and in a fixed
order over the groups (one group after another, the same for every row whatever the batch),
``y = Σ_g (e_x[g] · e_w[g]) · P_g / 4``: ``e_x · e_w`` is exact in float64 (two 24-bit significands),
each term rounds once, each addition once, and the result once more to the activations' dtype. This
is the checkpoint's math (``fp4_x · e_x`` times ``fp4_w · e_w`` summed over the inputs) with the
dequantized values never rounded; a row gets the same bits alone and in any batch.
"""

from __future__ import annotations

import itertools

import torch

GROUP = 16
FP4_MAX = 6.0
FP8_MAX = 448.0
FP8_EPS = 0.125  # compressed-tensors' replacement for a zero E4M3 scale
# Below these bounds, how many groups' code products one call forms at once (memory: chunk · M · N floats).
_CHUNK_ELEMS = 1 << 22


def fp4_half_codes(scaled: torch.Tensor) -> torch.Tensor:
    """``scaled`` (float32, already divided by its scale) clamped to ±6 and rounded to E2M1 as
    compressed-tensors' ``cast_to_fp4`` does, returned as int8 ``2 · fp4`` (integers in −12…12)."""
    x = torch.clamp(scaled, -FP4_MAX, FP4_MAX)
    a = x.abs()
    # the index of the E2M1 magnitude (0, 0.5, 1, 1.5, 2, 3, 4, 6); the alternating > / >= are its ties
    idx = ((a > 0.25).to(torch.int8) + (a >= 0.75).to(torch.int8) + (a > 1.25).to(torch.int8)
           + (a >= 1.75).to(torch.int8) + (a > 2.5).to(torch.int8) + (a >= 3.5).to(torch.int8)
           + (a > 5.0).to(torch.int8))
    half = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12], dtype=torch.int8)[idx.long()]
    return torch.where(x < 0, -half, half)


def quantize_nvfp4(x: torch.Tensor, global_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[M, K]`` (K a multiple of 16) → (int8 codes ``2 · fp4`` ``[M, K]``, float32 effective
    scales ``[M, K / 16]``), compressed-tensors' dynamic (local) NVFP4 activation quantization with the
    static float32 ``global_scale`` (one value). See the module docstring for each step."""
    m, k = x.shape
    groups = x.reshape(m, k // GROUP, GROUP)
    lo = torch.clamp(groups.amin(dim=-1), max=0)
    hi = torch.clamp(groups.amax(dim=-1), min=0)
    amax = torch.maximum(lo.abs(), hi.abs())  # in x's dtype
    scale = amax / torch.tensor(12.0).to(x.dtype).div(2)  # (q_max - q_min) / 2 in x's dtype, as calculate_qparams
    glob = global_scale.to(torch.float32).reshape(1)
    scale = glob * scale  # float32 (a 1-d float32 tensor times x's dtype)
    scale = torch.clamp(scale, -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(torch.float32)
    scale = torch.where(scale == 0, torch.tensor(FP8_EPS, dtype=torch.float32), scale)
    eff = scale / glob  # float32, the scale compressed-tensors divides and multiplies by
    codes = fp4_half_codes(groups / eff.unsqueeze(-1))
    return codes.reshape(m, k), eff


def group_products(xc: torch.Tensor, wc: torch.Tensor, ex: torch.Tensor, ew: torch.Tensor) -> torch.Tensor:
    """float64 ``[M, N]``: ``Σ_g (ex[:, g] · ew[:, g]) · (Σ_{k∈g} xc · wc)``, the groups added one after
    another in order (batch-invariant; see the module docstring). ``xc`` ``[M, K]`` / ``wc`` ``[N, K]``
    int8 half-codes, ``ex`` ``[M, G]`` / ``ew`` ``[N, G]`` float32 effective scales."""
    m, k = xc.shape
    n, g = wc.shape[0], k // GROUP
    xg = xc.reshape(m, g, GROUP).permute(1, 0, 2).to(torch.float32)  # [G, M, 16]
    wg = wc.reshape(n, g, GROUP).permute(1, 2, 0).to(torch.float32)  # [G, 16, N]
    ex64, ew64 = ex.to(torch.float64), ew.to(torch.float64)
    acc = torch.zeros(m, n, dtype=torch.float64)
    step = max(1, _CHUNK_ELEMS // max(1, m * n))
    for a in range(0, g, step):
        b = min(g, a + step)
        prods = torch.bmm(xg[a:b], wg[a:b])  # exact integers (|P| ≤ 2304)
        for j in range(b - a):
            acc += prods[j].to(torch.float64) * (ex64[:, a + j].unsqueeze(1) * ew64[:, a + j].unsqueeze(0))
    return acc * 0.25  # the half-codes' 2 · 2 (exact)


class W4A4Linear:
    """One NVFP4 W4A4 projection: the weight's half-codes ``codes`` (int8 ``2 · fp4`` ``[N, K]``), its
    effective scales ``scales`` (float32 ``[N, K / 16]``: E4M3 scale / global scale, as compressed-tensors
    divides them) and each output row's activation global scale ``input_scales`` (float32 ``[N]``; a
    fused projection's parts may differ, so the input is quantized once per run of rows sharing one).
    Owns nothing else: the model keeps the 1-byte codes."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, input_scales: torch.Tensor,
                 bias: torch.Tensor | None) -> None:
        if codes.shape[1] % GROUP:
            raise ValueError(f"an NVFP4 weight needs a multiple of {GROUP} inputs, got {codes.shape[1]}")
        self.codes, self.scales, self.bias = codes, scales.to(torch.float32), bias
        s = input_scales.to(torch.float32).reshape(-1)
        cuts = [0, *(torch.nonzero(s[1:] != s[:-1]).reshape(-1) + 1).tolist(), int(s.numel())]
        self.segments = [(a, b, s[a].clone()) for a, b in itertools.pairwise(cuts)]

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        parts = []
        for a, b, glob in self.segments:
            xc, ex = quantize_nvfp4(x, glob)
            parts.append(group_products(xc, self.codes[a:b], ex, self.scales[a:b]))
        y = (parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y if residual is None else residual + y
