"""RMSNorm, op for op with Hugging Face's in float32."""

from __future__ import annotations

from typing import Any

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


def norm(x: torch.Tensor, weight: torch.Tensor, eps: float, kernel_ops: Any) -> torch.Tensor:
    """RMSNorm on tripod's kernel when the step runs on the kernels, else ``rms_norm``."""
    if kernel_ops is not None:
        return kernel_ops.rms_norm(x, weight, eps)
    return rms_norm(x, weight, eps)


def head_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, kernel_ops: Any) -> torch.Tensor:
    """RMSNorm of every head: ``x`` ``[T, heads, head_dim]`` (any strides) → same shape."""
    t, h, d = x.shape
    return norm(x.reshape(t * h, d), weight, eps, kernel_ops).view(t, h, d)
