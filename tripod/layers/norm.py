"""RMSNorm, op for op with Hugging Face's in float32."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype != torch.float32:
        # The fused kernel: float32 inside, one rounding at the end (HF rounds once more,
        # before the weight; the difference is below bf16's own resolution).
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    # NOTE: float32 follows HF's LlamaRMSNorm op for op, so fp32 parity is exact.
    h = x
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h
