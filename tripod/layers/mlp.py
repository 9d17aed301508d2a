"""The gated MLP (SwiGLU, or GELU-tanh for Gemma): gate and up fused into one projection; its
backend applies the activation (torch's op: ``layers/activation.py``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tripod.layers.batch import Backend
from tripod.layers.linear import Fp8Scales, Linear, StoredWeight
from tripod.layers.lora import LoraBatch
from tripod.layers.parallel import SINGLE, ParallelGroup, columns, parameter, rows
from tripod.layers.weights import WeightSource


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))``; its projections prepared per compute form."""

    def __init__(self, hidden: int, inter: int, act: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.inter, self.act = inter, act
        self.gate_up = nn.Parameter(torch.empty(2 * inter, hidden, dtype=dtype), requires_grad=False)
        self.down = nn.Parameter(torch.empty(hidden, inter, dtype=dtype), requires_grad=False)
        self.ops: dict[str, tuple[Linear, Linear]] = {}
        self.fp8: dict[str, Fp8Scales] = {}  # scales of the weights kept in FP8
        self.tp = SINGLE  # whose sum this MLP's output is (SINGLE: complete here)

    def shard(self, tp: ParallelGroup, reduce: bool = True) -> None:
        """Keep this rank's intermediate columns: gate/up column-parallel, down row-parallel.
        ``reduce``: sum the output over the ranks here (False: the caller sums, e.g. a MoE's
        shared expert, whose partial output joins the experts' before one all-reduce)."""
        i0, i1 = tp.split(self.inter, "MLP's intermediate size")
        self.gate_up = parameter(rows(self.gate_up.data, (i0, i1), (self.inter + i0, self.inter + i1)))
        self.down = parameter(columns(self.down.data, i0, i1))
        self.inter = i1 - i0
        self.ops.clear()
        self.tp = tp if reduce else SINGLE

    def prepare(self, backend: Backend, stored: dict[str, StoredWeight]) -> None:
        if backend.form not in self.ops:
            self.ops[backend.form] = (
                backend.linear(self.gate_up, None, stored=stored.get("gate_up"), fp8=self.fp8.get("gate_up")),
                backend.linear(self.down, None, stored=stored.get("down"), fp8=self.fp8.get("down")),
            )

    def release(self, form: str) -> None:
        self.ops.pop(form, None)

    def load(self, src: WeightSource, prefix: str, names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")) -> None:
        g, u, d = names
        keep(self, "gate_up", src.cat([f"{prefix}{g}.weight", f"{prefix}{u}.weight"]))
        keep(self, "down", src.part(f"{prefix}{d}.weight"))

    def forward(self, h: torch.Tensor, backend: Backend, residual: torch.Tensor | None = None,
                lora: tuple[LoraBatch, int] | None = None) -> torch.Tensor:
        """``lora``: (the step's ``LoraBatch``, this MLP's layer) when rows run adapters."""
        gate_up, down = self.ops[backend.form]
        if lora is None:
            return self.tp.reduce(down(backend.activate(gate_up(h), self.inter, self.act), residual=self.tp.residual(residual)))
        adapters, layer = lora
        act = backend.activate(adapters.apply(layer, "gate_up", h, gate_up(h)), self.inter, self.act)
        return self.tp.reduce(adapters.apply(layer, "down", act, down(act, residual=self.tp.residual(residual))))


def keep(module: Any, name: str, part: tuple[torch.Tensor, Fp8Scales | None]) -> None:
    """Set ``module.<name>`` to a loaded weight, noting its FP8 scales when it stays FP8."""
    w, scales = part
    getattr(module, name).data = w.contiguous()
    if scales is not None:
        module.fp8[name] = scales
    else:
        module.fp8.pop(name, None)
