"""LFM2's gated short convolution, with an explicit per-sequence state.

One layer: ``in_proj`` → ``B, C, x`` (each ``hidden`` wide) → ``B·x`` → causal depthwise conv
(kernel ``L``, no activation) → ``C·conv`` → ``out_proj``.

State of one sequence: ``conv`` ``[hidden, L - 1]`` float32, the last ``L - 1`` inputs of the
convolution (``B·x``), oldest first; zeros before the first token. Batched: ``[S, hidden, L - 1]``
(``ShortConv.state_shape``, ``new_conv_state``).

NOTE: exactness. Elementwise products and the tap-by-tap convolution (``mamba2.causal_conv``), so
a sequence's rows and state do not depend on how its prefill is split nor on the batch.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from tripod.layers.batch import Backend
from tripod.layers.linear import Linear, StoredWeight
from tripod.layers.mamba2 import causal_conv
from tripod.layers.weights import WeightSource


def new_conv_state(hidden: int, kernel: int, seqs: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Zero windows for ``seqs`` sequences: ``[S, hidden, kernel - 1]`` float32."""
    return torch.zeros(seqs, hidden, kernel - 1, dtype=torch.float32, device=device)


class ShortConv(nn.Module):
    """One short-convolution layer's weights and math; owns no state (the caller's pool does)."""

    def __init__(self, hidden: int, kernel: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        if kernel < 2:
            raise ValueError(f"short conv: kernel {kernel} < 2")
        self.hidden, self.kernel = hidden, kernel
        self.in_proj = nn.Parameter(torch.empty(3 * hidden, hidden, dtype=dtype), requires_grad=False)
        self.conv_w = nn.Parameter(torch.empty(hidden, kernel, dtype=dtype), requires_grad=False)
        self.out_proj = nn.Parameter(torch.empty(hidden, hidden, dtype=dtype), requires_grad=False)
        self.in_bias = nn.Parameter(torch.zeros(3 * hidden, dtype=dtype), requires_grad=False) if bias else None
        self.conv_b = nn.Parameter(torch.zeros(hidden, dtype=dtype), requires_grad=False) if bias else None
        self.out_bias = nn.Parameter(torch.zeros(hidden, dtype=dtype), requires_grad=False) if bias else None
        self.ops: dict[str, tuple[Linear, Linear]] = {}

    @property
    def state_shape(self) -> tuple[int, int]:
        return self.hidden, self.kernel - 1

    def load(self, src: WeightSource, prefix: str) -> None:
        self.in_proj.data = src.get(prefix + "in_proj.weight").contiguous()
        self.conv_w.data = src.get(prefix + "conv.weight").reshape(self.hidden, self.kernel).contiguous()
        self.out_proj.data = src.get(prefix + "out_proj.weight").contiguous()
        if self.in_bias is not None and self.conv_b is not None and self.out_bias is not None:
            self.in_bias.data = src.get(prefix + "in_proj.bias")
            self.conv_b.data = src.get(prefix + "conv.bias")
            self.out_bias.data = src.get(prefix + "out_proj.bias")

    def prepare(self, backend: Backend, stored: Mapping[str, StoredWeight] | None = None) -> None:
        """``stored``: a GGUF's codes of ``in_proj`` / ``out_proj`` (run as stored on a backend that does)."""
        if backend.form not in self.ops:
            s = stored or {}
            self.ops[backend.form] = (backend.linear(self.in_proj, self.in_bias, stored=s.get("in_proj")),
                                      backend.linear(self.out_proj, self.out_bias, stored=s.get("out_proj")))

    def forward(self, h: torch.Tensor, backend: Backend, conv: torch.Tensor, lens: list[int],
                residual: torch.Tensor | None = None,
                trace: dict[int, list[torch.Tensor]] | None = None) -> torch.Tensor:
        """``h`` ``[T, hidden]``: the rows of ``len(lens)`` sequences one after another; ``conv``
        their windows ``[S, hidden, L-1]``, updated in place; ``trace``: the sequences whose windows
        before and after every row are wanted (``mamba2.causal_conv``). Returns ``[T, hidden]`` (``+ residual``)."""
        if sum(lens) != h.shape[0] or len(lens) != conv.shape[0]:
            raise ValueError(f"short conv: {h.shape[0]} rows, {conv.shape[0]} states for lengths {lens}")
        in_op, out_op = self.ops[backend.form]
        b, c, x = in_op(h).float().chunk(3, dim=-1)
        bias = self.conv_b.float() if self.conv_b is not None else None
        y = c * causal_conv(b * x, conv, lens, self.conv_w.float(), bias, trace)
        return out_op(y.to(h.dtype), residual=residual)
