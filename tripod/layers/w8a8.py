"""W8A8 linears (compressed-tensors ``int-quantized`` / ``float-quantized``): 8-bit weights with a
scale per output channel (or one per tensor), activations quantized per token, dynamically, as
the checkpoint says — emulated in torch on the CPU.

The activation quantization is compressed-tensors' own (``calculate_qparams`` and ``_quantize``,
symmetric, strategy ``token``, ``dynamic: true``), in the activations' dtype: per row, ``s_x =
max|x| / (range / 2)`` (INT8: ``255 / 2``; FP8 E4M3: ``896 / 2 = 448``), then INT8 ``round(clamp(x /
s_x, -128, 127))`` or FP8 ``clamp(x / s_x, -448, 448)`` cast to E4M3.

The product is then exact: ``Σ_k qx_k · qw_k`` in float64 holds every partial sum exactly (INT8:
products < 2^14; FP8: every E4M3 value is a multiple of 2^-9 below 2^9, products multiples of
2^-18 below 2^18 — under 2^53 for K < 2^17 inputs either way), so its value never depends on the
summation order (the same bits alone or in any batch); ``y = acc · (s_x · s_w)`` rounds once in
float64 and once to the run dtype. This is the value of the checkpoint's quantized activations
times its quantized weights, as ``int8 x int8 -> int32`` (or FP8 ``_scaled_mm``) hardware forms it,
up to that final rounding. No int8 dot-product kernel of tripod's runs it yet (see
``docs/quantized.md``).
"""

from __future__ import annotations

import torch

W8A8_KINDS = {"W8A8_INT8": "int8", "W8A8_FP8": "fp8"}
_RANGE = {"int8": 127.5, "fp8": 448.0}  # compressed-tensors: (q_max - q_min) / 2


def quantize_per_token(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[M, K]`` → (codes as float64 ``[M, K]``: integers for INT8, E4M3 values for FP8;
    scales ``[M, 1]`` in ``x``'s dtype), compressed-tensors' dynamic per-token symmetric quantization."""
    amax = x.abs().amax(dim=1, keepdim=True)
    scale = amax / torch.tensor(_RANGE[kind], dtype=x.dtype)
    # (an all-zero row: any positive scale gives codes 0; compressed-tensors puts its dtype's eps there)
    scale = torch.where(scale == 0, torch.tensor(torch.finfo(x.dtype).eps, dtype=x.dtype), scale)
    scaled = x / scale
    if kind == "int8":
        q = torch.round(torch.clamp(scaled, -128.0, 127.0))
    else:
        q = torch.clamp(scaled, -448.0, 448.0).to(torch.float8_e4m3fn)
    return q.to(torch.float64), scale


class W8A8Linear:
    """One W8A8 projection: ``codes`` (int8 or float8_e4m3fn ``[N, K]``, as stored) and the weight
    scales ``[N]`` (float32). Owns its float64 copy of the codes only while it runs (made per call:
    the model keeps the 1-byte codes)."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, kind: str, bias: torch.Tensor | None) -> None:
        self.codes, self.scales, self.kind, self.bias = codes, scales.to(torch.float64), kind, bias

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        q, sx = quantize_per_token(x, self.kind)
        acc = q @ self.codes.to(torch.float64).t()  # exact (module docstring)
        y = (acc * (sx.to(torch.float64) * self.scales)).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y if residual is None else residual + y
