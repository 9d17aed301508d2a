"""Block-wise FP8 weights (DeepSeek-format checkpoints: e4m3 with a float32 scale per block).

``Fp8BlockLinear`` (w8a16, anywhere) and, on FP8 tensor cores (sm_89 and later),
``Fp8ScaledLinear``: DeepSeek's recipe through ``torch._scaled_mm``, which takes one scale per row of each operand — so the product runs as one
row-wise scaled FP8 GEMM per ``bk``-column block of the weight, summed in float32. The activation
is quantized per token and per block (scale = the block's max |x| / 448, e4m3's largest value); the
weight's block scale becomes a per-output-row scale within a column block. This is w8a8: the
activations' rounding to FP8 changes the result by e4m3's precision (as DeepSeek's own inference
does); the w8a16 path (``Fp8BlockLinear``: bands of the weight dequantized, 16-bit activations) is
what runs elsewhere, and where this one does not apply (shapes not multiples of 16, no FP8 tensor
cores), saying so once in the log."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

E4M3_MAX = 448.0


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass(frozen=True, slots=True)
class Fp8Scales:
    """The per-block scales of an FP8 weight: ``scale_inv`` ``[ceil(N/bn), ceil(K/bk)]`` float32."""

    scale_inv: torch.Tensor
    block: tuple[int, int]


def dequantize_fp8(w: torch.Tensor, sc: Fp8Scales, dtype: torch.dtype, rows: slice | None = None) -> torch.Tensor:
    """``w`` (or its rows ``rows``, starting on a block boundary) dequantized to ``dtype``."""
    bn, bk = sc.block
    start = 0 if rows is None else rows.start
    part = w if rows is None else w[rows]
    n, k = part.shape
    s = sc.scale_inv[start // bn : start // bn + -(-n // bn)]
    s = s.repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]
    return (part.to(torch.float32) * s).to(dtype)


class Fp8BlockLinear:
    """w8a16: the weight stays FP8; bands of block rows are dequantized inside the call."""

    MAX_BAND = 1 << 22  # dequantized values alive at once

    def __init__(self, weight: torch.Tensor, scales: Fp8Scales, bias: torch.Tensor | None) -> None:
        self.weight, self.scales, self.bias = weight, scales, bias
        n, k = weight.shape
        bn = scales.block[0]
        self.band = max(bn, (self.MAX_BAND // max(k, 1)) // bn * bn)
        self.out_features = n

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        n = self.out_features
        if n <= self.band:
            y = F.linear(x, dequantize_fp8(self.weight, self.scales, x.dtype), self.bias)
        else:
            y = x.new_empty((x.shape[0], n))
            for i in range(0, n, self.band):
                rows = slice(i, min(i + self.band, n))
                b = None if self.bias is None else self.bias[rows]
                y[:, rows] = F.linear(x, dequantize_fp8(self.weight, self.scales, x.dtype, rows), b)
        return y if residual is None else residual + y


def quantize_blocks(x: torch.Tensor, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[M, K]`` as e4m3 with one float32 scale per row per ``bk`` columns: ``(q [M, K],
    scales [M, ceil(K/bk)])``, ``x ≈ q * scales`` blockwise."""
    m, k = x.shape
    nb = -(-k // bk)
    pad = nb * bk - k
    xf = torch.nn.functional.pad(x.float(), (0, pad)).view(m, nb, bk)
    scale = (xf.abs().amax(dim=-1) / E4M3_MAX).clamp_min(1e-12)
    q = (xf / scale.unsqueeze(-1)).to(torch.float8_e4m3fn).view(m, nb * bk)[:, :k]
    return q, scale


def unsupported_reason(weight: torch.Tensor, scales: Fp8Scales, *, force: bool = False) -> str | None:
    """Why ``torch._scaled_mm`` cannot run this weight here (None: it can). ``force``: skip the
    device check (the CPU runs the same calls, for the tests)."""
    n, k = weight.shape
    bn, bk = scales.block
    if weight.dtype != torch.float8_e4m3fn:
        return f"{weight.dtype} weights (the FP8 GEMM takes e4m3)"
    if n % 16 or k % 16 or bk % 16:
        return f"a {n}x{k} weight in {bn}x{bk} blocks (the FP8 GEMM needs multiples of 16)"
    if force:
        return None
    if weight.device.type != "cuda":
        return "no FP8 tensor cores on this device"
    if torch.cuda.get_device_capability(weight.device) < (8, 9):
        return "this GPU has no FP8 tensor cores (sm_89 or later)"
    return None


class Fp8ScaledLinear:
    """w8a8 block-wise FP8: ``y = Σ_j (q_x[:, j] · W[:, j]ᵀ) · s_x[:, j] · s_W[:, j]`` over column blocks j."""

    def __init__(self, weight: torch.Tensor, scales: Fp8Scales, bias: torch.Tensor | None) -> None:
        n, k = weight.shape
        bn, bk = scales.block
        self.bk, self.out_features, self.bias = bk, n, bias
        self.blocks = [weight[:, s : s + bk].contiguous() for s in range(0, k, bk)]  # [N, bk] each
        rows = scales.scale_inv.float().repeat_interleave(bn, dim=0)[:n]  # [N, ceil(K/bk)]
        self.row_scales = [rows[:, j].contiguous().view(1, n) for j in range(len(self.blocks))]

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        m = x.shape[0]
        q, sx = quantize_blocks(x, self.bk)
        y = torch.zeros((m, self.out_features), dtype=torch.float32, device=x.device)
        for j, (w, sw) in enumerate(zip(self.blocks, self.row_scales, strict=True)):
            a = q[:, j * self.bk : j * self.bk + w.shape[1]].contiguous()
            part = torch._scaled_mm(a, w.t(), scale_a=sx[:, j : j + 1].contiguous(), scale_b=sw,
                                    out_dtype=torch.bfloat16)
            y += part.float()
        if self.bias is not None:
            y += self.bias.float()
        out = y.to(x.dtype)
        return out if residual is None else residual + out


@functools.cache
def report_fp8(reason: str | None) -> None:
    """Say once per reason which FP8 path the weights take."""
    if reason is None:
        log.info("FP8 weights: block-wise FP8 GEMMs on the tensor cores (torch._scaled_mm, w8a8)")
    else:
        log.info("FP8 weights: dequantized band by band to 16 bits (w8a16), not torch._scaled_mm: %s", reason)
