"""W8A8 linears (compressed-tensors ``int-quantized`` / ``float-quantized``): 8-bit weights with a
scale per output channel (or one per tensor), activations quantized as the checkpoint says —
dynamically per token, or with the static per-tensor scale it stores (``input_scale``).

Dynamic activation quantization is compressed-tensors' own (``calculate_qparams`` and ``_quantize``,
symmetric, strategy ``token``, ``dynamic: true``), in the activations' dtype: per row, ``s_x =
max|x| / (range / 2)`` (INT8: ``255 / 2``; FP8 E4M3: ``896 / 2 = 448``), then INT8 ``round(clamp(x /
s_x, -128, 127))`` or FP8 ``clamp(x / s_x, -448, 448)`` cast to E4M3. Static scales (strategy
``tensor``, ``dynamic: false``): the same rounding with the checkpoint's ``s_x``, held in float32 and
applied in float32 (``x.float() / s_x``), one scale for every row.

The product is exact. INT8 runs on integer math (int8 × int8 → int32), which sums the code
products exactly (each below 2^14 in magnitude, so no overflow for K < 2^17 inputs), so its value
never depends on the summation order, the batch or the code that formed it: on the CPU kernels'
backend tripod's own ``int8_linear`` (``kernels/csrc/int8.cpp``: AVX512-VNNI ``vpdpbusd``, or
``vpmaddwd`` on sign-extended codes on AVX-512BW / AVX2) over the stored codes for up to
``KERNEL_MAX_ROWS`` rows (decode), ``torch._int_mm`` for more rows and everywhere else — the same
int32, so switching between them by row count keeps a row's bits alone and batched. FP8 (and INT8 where ``_int_mm`` refuses a
shape, or K ≥ 2^17) sums the products in float64, which holds every partial sum exactly (INT8: the
same integers; FP8: every E4M3 value is a multiple of 2^-9 below 2^9, products multiples of 2^-18
below 2^18 — under 2^53 for K < 2^17) — the same bits as the integer path. ``y = acc · (s_x · s_w)``
then rounds once in float64 and once to the run dtype.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

W8A8_KINDS = {"W8A8_INT8": "int8", "W8A8_FP8": "fp8"}
_RANGE = {"int8": 127.5, "fp8": 448.0}  # compressed-tensors: (q_max - q_min) / 2
# |qx · qw| <= 128 · 128 = 2^14: an int32 (and a float64) sum of fewer than 2^17 such products is exact.
MAX_EXACT_K = 2**17
# Rows up to which the CPU kernels' int8_linear forms the INT8 product (above: torch._int_mm, whose
# oneDNN kernel is faster at many rows here; benchmarks/results/w8a8_kernel.md). Speed only: both
# give the exact integer sums.
KERNEL_MAX_ROWS = 16


def _round_codes(scaled: torch.Tensor, kind: str) -> torch.Tensor:
    """compressed-tensors' ``round_to_quantized_type``: INT8 ``round(clamp(v, -128, 127))`` as int8,
    FP8 ``clamp(v, -448, 448)`` cast to E4M3."""
    if kind == "int8":
        return torch.round(torch.clamp(scaled, -128.0, 127.0)).to(torch.int8)
    return torch.clamp(scaled, -448.0, 448.0).to(torch.float8_e4m3fn)


def quantize_per_token(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[M, K]`` → (codes ``[M, K]``: int8 or float8_e4m3fn; scales ``[M, 1]`` in ``x``'s
    dtype), compressed-tensors' dynamic per-token symmetric quantization."""
    amax = x.abs().amax(dim=1, keepdim=True)
    scale = amax / torch.tensor(_RANGE[kind], dtype=x.dtype)
    # (an all-zero row: any positive scale gives codes 0; compressed-tensors puts its dtype's eps there)
    scale = torch.where(scale == 0, torch.tensor(torch.finfo(x.dtype).eps, dtype=x.dtype), scale)
    return _round_codes(x / scale, kind), scale


def quantize_static(x: torch.Tensor, scale: torch.Tensor, kind: str) -> torch.Tensor:
    """``x`` ``[M, K]`` → codes with the checkpoint's static per-tensor scale (float32, one value):
    ``x / s_x`` in float32, then compressed-tensors' rounding."""
    return _round_codes(x.to(torch.float32) / scale, kind)


def code_product(q: torch.Tensor, codes: torch.Tensor, ops: Any = None, wsum: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """``Σ_k q[m, k] · codes[n, k]`` exactly, as float64 ``[M, N]`` (see the module docstring): int32
    from the CPU kernels' ``int8_linear`` (``ops``; ``wsum``: ``Σ_k codes[n, k]`` int32, which its
    VNNI path needs) for int8 codes and up to ``KERNEL_MAX_ROWS`` rows, else ``torch._int_mm`` where
    it runs, else the float64 sum (the same value)."""
    if q.dtype == torch.int8 and codes.dtype == torch.int8 and q.shape[1] < MAX_EXACT_K and q.shape[0] > 0:
        if ops is not None and q.shape[0] <= KERNEL_MAX_ROWS:
            return ops.int8_linear(q, codes, wsum).to(torch.float64)
        try:
            return torch._int_mm(q.contiguous(), codes.t()).to(torch.float64)
        except RuntimeError:
            pass  # a shape or layout this torch's _int_mm refuses: the float64 sum below, same bits
    return q.to(torch.float64) @ codes.to(torch.float64).t()


def scaled_product(q: torch.Tensor, codes: torch.Tensor, sx: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype,
                   ops: Any = None, wsum: torch.Tensor | None = None) -> torch.Tensor:
    """``(Σ_k q[m, k] · codes[n, k]) · (sx[m] · scales[n])`` rounded once in float64, then to ``dtype``
    (``sx`` float64 ``[M]``, ``scales`` float64 ``[N]``): the CPU kernels' ``int8_linear_scaled``
    (product and epilogue in one call, the same operations and roundings) where ``code_product``
    would run the kernel and ``dtype`` is float32 or bfloat16, else torch's ops."""
    m = q.shape[0]
    if (ops is not None and 0 < m <= KERNEL_MAX_ROWS and q.dtype == torch.int8 and codes.dtype == torch.int8
            and q.shape[1] < MAX_EXACT_K and dtype in (torch.float32, torch.bfloat16)):
        return ops.int8_linear_scaled(q, codes, wsum, sx, scales, dtype)
    return (code_product(q, codes, ops, wsum) * (sx.unsqueeze(1) * scales)).to(dtype)


class W8A8Linear:
    """One W8A8 projection: ``codes`` (int8 or float8_e4m3fn ``[N, K]``, as stored), the weight
    scales ``[N]`` (float32) and, for static activation scales, ``input_scales`` ``[N]`` (float32:
    each output row's activation scale; a fused projection's parts may each have their own, so the
    input is quantized once per run of rows sharing one). Owns nothing beyond those: the model keeps
    the 1-byte codes, any wider copy is made per call. ``ops``: the CPU kernels of one level, whose
    ``int8_linear`` then forms INT8 products over the codes as stored (``code_product``); it keeps
    each row's ``Σ_k codes[n, k]`` (int32 ``[N]``) for them."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, kind: str, bias: torch.Tensor | None,
                 input_scales: torch.Tensor | None = None, ops: Any = None) -> None:
        self.codes, self.scales, self.kind, self.bias = codes, scales.to(torch.float64), kind, bias
        self.input_scales = input_scales
        # (a library built before int8_linear existed, or FP8 codes: torch's path)
        self.ops = ops if kind == "int8" and ops is not None and hasattr(ops, "int8_linear_scaled") else None
        self.wsum = codes.sum(1, dtype=torch.int32) if self.ops is not None else None
        # runs of output rows [a, b) sharing one static activation scale (float32 scalar tensor)
        self.segments: list[tuple[int, int, torch.Tensor]] = []
        if input_scales is not None:
            s = input_scales.to(torch.float32).reshape(-1)
            cuts = [0, *(torch.nonzero(s[1:] != s[:-1]).reshape(-1) + 1).tolist(), int(s.numel())]
            self.segments = [(a, b, s[a].clone()) for a, b in itertools.pairwise(cuts)]

    @property
    def static(self) -> bool:
        return self.input_scales is not None

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if not self.segments:
            q, sx = quantize_per_token(x, self.kind)
            # exact product (module docstring), one float64 rounding of the scaled sum, one to the dtype
            y = scaled_product(q, self.codes, sx.reshape(-1).to(torch.float64), self.scales, x.dtype, self.ops, self.wsum)
        else:
            parts = []
            for a, b, s in self.segments:
                wsum = self.wsum[a:b] if self.wsum is not None else None
                sx = s.to(torch.float64).expand(x.shape[0]).contiguous()
                parts.append(scaled_product(quantize_static(x, s, self.kind), self.codes[a:b], sx, self.scales[a:b],
                                            x.dtype, self.ops, wsum))
            y = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)  # (a concatenation: exact)
        if self.bias is not None:
            y = y + self.bias
        return y if residual is None else residual + y
