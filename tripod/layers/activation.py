"""The gated activation on torch's ops (SwiGLU, or Gemma's GELU-tanh): what every backend falls
back to where it has no kernel of its own, and what the experts of a MoE apply."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def activate(gu: torch.Tensor, inter: int, act: str) -> torch.Tensor:
    """``act(gate) * up`` of a fused ``[T, 2 * inter]`` gate/up output, on torch's ops."""
    g, u = gu.split([inter, inter], dim=-1)
    if act == "silu":
        return F.silu(g) * u
    return F.gelu(g, approximate="tanh") * u
