"""Mixture-of-experts MLP: routing in one vectorised pass, then grouped dispatch.

Routing (``route``) covers the families' rules: softmax or sigmoid scores, optional group-limited
choice (DeepSeek-V2's best-expert group score, V3's sum of the best two after the correction
bias), renormalisation of the chosen weights and the routed scaling factor. Dispatch sorts the
(token, expert) pairs by expert and runs one fused gate/up matmul and one down matmul per *active*
expert over all of its tokens, then adds the weighted results back per token: the Python loop is
over experts that received tokens, never over tokens.

An ``ExpertSet`` (a layer's experts: stacked ``[E, 2I, H]`` gate/up and ``[E, H, I]`` down) is
the unit that could live on another device for expert parallelism: it takes tokens and their
expert assignment and returns their weighted sum; nothing else in the layer touches its weights.

Experts of a quantized checkpoint (AWQ / GPTQ / compressed-tensors integer groups, ``--weights
stored``) can run as stored codes instead: each expert's fused gate/up and its down projection as
a ``StoredWeight`` (``ExpertSet.stored``), executed by the CPU kernels' stored linear over the rows
routed to it (``ExpertSet.ops``, one per compute form). The kernels compute every row on its own,
in the same order whatever the row count, so a token's output does not depend on which other
tokens reached the same expert; the loop over experts and the weighted sum are the dense path's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from tripod.layers.activation import activate
from tripod.layers.batch import Backend
from tripod.layers.linear import (
    STORED_KINDS,
    Fp8Scales,
    KernelLinear,
    Linear,
    StoredWeight,
    dequantize_fp8,
    fuse_rows,
    narrowed_kind,
    released,
)
from tripod.layers.mlp import GatedMLP, keep
from tripod.layers.parallel import SINGLE, ParallelGroup, columns, parameter, rows
from tripod.layers.topk import topk_by_position
from tripod.layers.weights import WeightSource, dequantize_mxfp4


@dataclass(frozen=True, slots=True)
class MoEConfig:
    """A sparse MLP: ``top_k`` of ``num_experts`` gated SwiGLU experts per token."""

    num_experts: int
    top_k: int
    intermediate_size: int  # per expert
    scoring: str = "softmax"  # "softmax" | "sigmoid" (DeepSeek-V3) | "sqrtsoftplus" (DeepSeek-V4)
    norm_topk_prob: bool = True  # renormalize the chosen experts' weights to sum to 1
    routed_scaling_factor: float = 1.0
    # Expert choice restricted to the best ``topk_group`` of ``n_group`` expert groups
    # ("greedy": no groups; "group_max": a group scores its best expert (DeepSeek-V2);
    # "group_top2": the sum of its best two, after the correction bias (DeepSeek-V3)).
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    correction_bias: bool = False  # V3's e_score_correction_bias: used to choose, not to weight
    shared_intermediate_size: int = 0  # 0: no shared expert
    shared_gate: bool = False  # Qwen2-MoE: the shared expert's output scaled by sigmoid(gate(x))
    dense_layers: tuple[int, ...] = ()  # layers whose MLP is dense (``intermediate_size``)
    # gpt-oss: a bias on the router's logits and on each expert's projections, and the clamped
    # SwiGLU ``(clamp(up) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate, limit)``.
    router_bias: bool = False
    expert_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    # DeepSeek-V4 clamps the plain SwiGLU instead: ``silu(min(gate, limit)) * clamp(up, ±limit)``.
    swiglu_style: str = "gpt_oss"  # "gpt_oss" | "clamp"


def route(logits: torch.Tensor, spec: MoEConfig, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits`` float32 ``[T, E]`` → (weights float32 ``[T, k]``, expert ids ``[T, k]``)."""
    if spec.scoring == "topk_softmax":  # gpt-oss: the k largest logits, softmaxed among themselves
        top, idx = topk_by_position(logits, spec.top_k)
        return top.softmax(dim=-1), idx
    scores = score(logits, spec.scoring)
    choice = scores + bias if bias is not None else scores
    if spec.topk_method != "greedy" and spec.n_group > 1:
        t, e = choice.shape
        grouped = choice.view(t, spec.n_group, e // spec.n_group)
        if spec.topk_method == "group_top2":
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # values only: ties cannot matter
        else:
            group_scores = grouped.max(dim=-1).values
        keep = topk_by_position(group_scores, spec.topk_group)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, keep, 1.0).bool()
        expert_mask = group_mask.unsqueeze(-1).expand(-1, -1, e // spec.n_group).reshape(t, e)
        # V3 masks out with -inf (its scores can be any sign after the bias); V2 with 0.
        fill = float("-inf") if spec.topk_method == "group_top2" else 0.0
        choice = choice.masked_fill(~expert_mask, fill)
    idx = topk_by_position(choice, spec.top_k)[1]
    return chosen_weights(scores, idx, spec), idx


def score(logits: torch.Tensor, scoring: str) -> torch.Tensor:
    if scoring == "sigmoid":
        return logits.sigmoid()
    if scoring == "sqrtsoftplus":
        return torch.nn.functional.softplus(logits).sqrt()
    return logits.softmax(dim=-1)


def chosen_weights(scores: torch.Tensor, idx: torch.Tensor, spec: MoEConfig) -> torch.Tensor:
    """The chosen experts' scores, renormalised (when the family does) and scaled."""
    weights = scores.gather(1, idx)
    if spec.norm_topk_prob:
        denom = weights.sum(dim=-1, keepdim=True)
        weights = weights / (denom + 1e-20) if spec.scoring != "softmax" else weights / denom
    if spec.routed_scaling_factor != 1.0:
        weights = weights * spec.routed_scaling_factor
    return weights


class ExpertSet(nn.Module):
    """A layer's routed experts, stacked; with ``stored``, each expert's projections as stored codes
    (quantized checkpoints, ``--weights stored``) run by the CPU kernels' stored linears (``ops``)."""

    def __init__(self, num_experts: int, hidden: int, inter: int, act: str, dtype: torch.dtype,
                 spec: MoEConfig | None = None) -> None:
        super().__init__()
        self.num_experts, self.inter, self.act = num_experts, inter, act
        self.gate_up = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden, dtype=dtype), requires_grad=False)
        self.down = nn.Parameter(torch.empty(num_experts, hidden, inter, dtype=dtype), requires_grad=False)
        biased = spec is not None and spec.expert_bias
        self.gate_up_bias = nn.Parameter(torch.zeros(num_experts, 2 * inter, dtype=dtype), requires_grad=False) if biased else None
        self.down_bias = nn.Parameter(torch.zeros(num_experts, hidden, dtype=dtype), requires_grad=False) if biased else None
        self.limit = spec.swiglu_limit if spec is not None else None
        self.alpha = spec.swiglu_alpha if spec is not None else 1.702
        self.style = spec.swiglu_style if spec is not None else "gpt_oss"
        self.fp8: dict[str, Fp8Scales] = {}  # stacked scales [E, rows, cols] of weights kept in FP8
        self.first = 0  # the global index of this rank's first expert (expert parallel)
        # Per expert, its fused gate/up ("gate_up.{e}") and down ("down.{e}") as stored codes; set only
        # where every expert has both (``load_stored``), and only for a whole, unsharded set.
        self.stored: dict[str, StoredWeight] = {}
        # The stored form's linears per compute form: (gate_up of expert 0, down of expert 0, ...).
        self.ops: dict[str, tuple[Linear, ...]] = {}
        self.source: tuple[str, tuple[str, str, str]] = ("", ("", "", ""))  # the stored codes' HF prefix and names
        self.sharded = False

    def shard_columns(self, tp: ParallelGroup) -> None:
        """Tensor parallel: every expert, this rank's intermediate columns of each."""
        i0, i1 = tp.split(self.inter, "experts' intermediate size")
        self.gate_up = parameter(rows(self.gate_up.data, (i0, i1), (self.inter + i0, self.inter + i1)))
        self.down = parameter(columns(self.down.data, i0, i1))
        self.sharded, self.stored = True, {}  # (the stored codes are whole experts: the dense slices run)
        self.ops.clear()
        if self.gate_up_bias is not None:
            self.gate_up_bias = parameter(rows(self.gate_up_bias.data, (i0, i1), (self.inter + i0, self.inter + i1)))
        if self.down_bias is not None and not tp.first:  # a row-parallel output's bias counts once
            self.down_bias = parameter(torch.zeros_like(self.down_bias.data))
        self.inter = i1 - i0

    def shard_experts(self, tp: ParallelGroup) -> None:
        """Expert parallel: this rank's experts, whole."""
        e0, e1 = tp.split(self.num_experts, "number of routed experts")
        self.gate_up = parameter(self.gate_up.data[e0:e1].contiguous())
        self.down = parameter(self.down.data[e0:e1].contiguous())
        self.sharded, self.stored = True, {}
        self.ops.clear()
        if self.gate_up_bias is not None and self.down_bias is not None:
            self.gate_up_bias = parameter(self.gate_up_bias.data[e0:e1].contiguous())
            self.down_bias = parameter(self.down_bias.data[e0:e1].contiguous())
        self.first, self.num_experts = e0, e1 - e0

    def load(self, src: WeightSource, prefix: str, names: tuple[str, str, str]) -> None:
        """Per-expert tensors (``{prefix}{e}.gate_proj.weight`` …) or the stacked form some
        checkpoints hold (``{prefix}gate_up_proj`` ``[E, 2I, H]``, ``{prefix}down_proj``)."""
        if src.has(prefix + "gate_up_proj"):
            keep(self, "gate_up", src.part(prefix + "gate_up_proj"))
            keep(self, "down", src.part(prefix + "down_proj"))
            return
        g, u, d = names
        E = range(self.num_experts)
        keep(self, "gate_up", src.stack([src.cat([f"{prefix}{e}.{g}.weight", f"{prefix}{e}.{u}.weight"]) for e in E]))
        keep(self, "down", src.stack([src.part(f"{prefix}{e}.{d}.weight") for e in E]))

    def load_interleaved(self, src: WeightSource, prefix: str) -> None:
        """gpt-oss's stacked experts: ``gate_up_proj`` ``[E, H, 2I]`` with gate and up columns
        interleaved (even, odd), ``down_proj`` ``[E, I, H]``, and their biases."""
        if src.has(prefix + "gate_up_proj_blocks"):  # MXFP4: stored [E, out, in], dequantized at load
            gu = self._mxfp4(src, prefix + "gate_up_proj")  # [E, 2I interleaved, H]
            self.gate_up.data = torch.cat((gu[:, ::2], gu[:, 1::2]), dim=1).contiguous()
            self.down.data = self._mxfp4(src, prefix + "down_proj").contiguous()
        else:
            gu = src.get(prefix + "gate_up_proj")
            self.gate_up.data = torch.cat((gu[..., ::2], gu[..., 1::2]), dim=-1).transpose(1, 2).contiguous()
            self.down.data = src.get(prefix + "down_proj").transpose(1, 2).contiguous()
        if self.gate_up_bias is not None and self.down_bias is not None:
            b = src.get(prefix + "gate_up_proj_bias")
            self.gate_up_bias.data = torch.cat((b[..., ::2], b[..., 1::2]), dim=-1).contiguous()
            self.down_bias.data = src.get(prefix + "down_proj_bias").contiguous()

    def load_stored(self, stored: Mapping[str, StoredWeight], prefix: str, names: tuple[str, str, str]) -> bool:
        """Keep each expert's stored codes (``{prefix}{e}.{gate}.weight`` … under HF names) when every
        expert has its three projections in one kind the CPU kernels execute (gate and up fused
        along their rows, as the dense ``gate_up``); else keep none (the experts run dequantized).
        Returns whether they were kept."""
        self.stored, self.ops = {}, {}
        if self.sharded or self.gate_up_bias is not None:
            return False
        g, u, d = names
        found: dict[str, StoredWeight] = {}
        for e in range(self.num_experts):
            gate, up, down = (stored.get(f"{prefix}{e}.{n}.weight") for n in (g, u, d))
            fused, alone = _fuse_rows(gate, up), _fuse_rows(down)
            if fused is None or alone is None:
                return False
            found[f"gate_up.{e}"], found[f"down.{e}"] = fused, alone
        self.stored, self.source = found, (prefix, names)
        return True

    def prepare(self, backend: Backend) -> None:
        """The stored form's linears (one gate/up and one down per expert) on a backend that executes
        stored codes (the CPU kernels' ``stored`` forms); every other backend runs the dense stack."""
        if not self.stored or backend.form in self.ops or not backend.form.startswith("stored:"):
            return
        ops: list[Linear] = []
        for e in range(self.num_experts):
            for name in ("gate_up", "down"):
                w = getattr(self, name)
                # (the weight's shape only: a stored kind the kernels take never reads it)
                ops.append(backend.linear(w[e], None, stored=self.stored[f"{name}.{e}"]))
        self.ops[backend.form] = tuple(ops)

    def release(self, form: str) -> None:
        self.ops.pop(form, None)

    def release_dense(self, form: str) -> int:
        """After ``form``'s stored linears are built: keep one copy of the codes (the kernels' packed
        blocks, which ``stored`` then holds) and drop the dense stacks. Returns the bytes given back.
        NOTE: afterwards only a stored form runs these experts (``forward`` refuses another)."""
        ops = self.ops.get(form)
        if ops is None:
            return 0
        freed = 0
        for e in range(self.num_experts):
            for j, name in enumerate(("gate_up", "down")):
                key, op = f"{name}.{e}", ops[2 * e + j]
                sw = self.stored[key]
                packed = getattr(op, "packed", None)
                fmt = getattr(op, "fmt", None)  # (a Q4_K-form weight may run as Q4_0 / Q4_1: narrowed_kind)
                if sw.packed or packed is None or fmt != STORED_KINDS[narrowed_kind(sw)]:
                    continue
                freed += sw.blocks.numel() * sw.blocks.element_size()
                self.stored[key] = StoredWeight(fmt.upper(), packed, sw.shape, sw.perm, packed=True)
        for name in ("gate_up", "down"):
            w = getattr(self, name)
            if w.shape[1]:
                freed += w.numel() * w.element_size()
                w.data = w.data.new_empty((w.shape[0], 0, w.shape[2]))  # [E, 0, K]: no memory
        return freed

    @property
    def released(self) -> bool:
        return self.gate_up.shape[1] == 0

    def _mxfp4(self, src: WeightSource, name: str) -> torch.Tensor:
        w = dequantize_mxfp4(src.raw(name + "_blocks"), src.raw(name + "_scales"), src.dtype)
        return w.to(src.device)

    def _activate(self, gu: torch.Tensor) -> torch.Tensor:
        if self.limit is None:
            return activate(gu, self.inter, self.act)
        g, u = gu.split([self.inter, self.inter], dim=-1)
        g = g.clamp(max=self.limit)
        u = u.clamp(min=-self.limit, max=self.limit)
        if self.style == "clamp":
            return activate(torch.cat((g, u), dim=-1), self.inter, self.act)
        return (u + 1) * (g * torch.sigmoid(g * self.alpha))

    def weight(self, name: str, e: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert ``e``'s ``gate_up`` or ``down`` in ``dtype`` (an FP8 one dequantized now)."""
        w = getattr(self, name)[e]
        sc = self.fp8.get(name)
        if sc is None:
            return w
        return dequantize_fp8(w, Fp8Scales(sc.scale_inv[e], sc.block), dtype)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, form: str | None = None) -> torch.Tensor:
        """``x`` ``[T, H]``, ``weights``/``idx`` ``[T, k]`` → the weighted sum ``[T, H]``. ``form``: the
        step's compute form (its stored linears run the experts where built; else the dense stacks)."""
        ops = self.ops.get(form) if form is not None else None
        if ops is None and self.released:
            raise ValueError(
                "this model's dense expert weights were released after their stored codes were packed for tripod's "
                "CPU kernels (--weights stored keeps only the stored form in memory); only the stored form can run "
                "them: load the model again with --weights dequantized for another compute path"
            )
        k = idx.shape[1]
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
        tokens = order // k
        w = weights.reshape(-1)[order].to(x.dtype).unsqueeze(1)
        counts = torch.bincount(flat, minlength=self.first + self.num_experts).tolist()
        out = torch.zeros_like(x)
        start = sum(counts[: self.first])  # (pairs routed to other ranks' experts come first)
        for e in range(self.num_experts):
            n = counts[self.first + e]
            if n == 0:
                continue
            picked = tokens[start : start + n]
            xs = x.index_select(0, picked)
            if ops is not None:  # the stored codes (the kernels' rows are independent: alone = batched)
                y = ops[2 * e + 1](self._activate(ops[2 * e](xs)))
            else:
                gu = xs @ self.weight("gate_up", e, x.dtype).t()
                if self.gate_up_bias is not None:
                    gu = gu + self.gate_up_bias[e]
                y = self._activate(gu) @ self.weight("down", e, x.dtype).t()
            if self.down_bias is not None:
                y = y + self.down_bias[e]
            out.index_add_(0, picked, y * w[start : start + n])
            start += n
        return out


class MoE(nn.Module):
    """Router + routed experts (+ a shared expert, gated for Qwen2-MoE)."""

    def __init__(self, spec: MoEConfig, hidden: int, act: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.spec = spec
        # engine/routed_experts.py: a list while a step captures the expert ids it routes to, else None.
        self.routed: list[torch.Tensor] | None = None
        # NOTE: the router runs in float32 whatever the model's dtype (DeepSeek's own rule; for
        # the other families it only matters in bf16, where it can move a near-tied choice).
        self.router = nn.Parameter(torch.empty(spec.num_experts, hidden, dtype=torch.float32), requires_grad=False)
        self.bias = (
            nn.Parameter(torch.zeros(spec.num_experts, dtype=torch.float32), requires_grad=False)
            if spec.correction_bias else None
        )
        self.router_bias = (
            nn.Parameter(torch.zeros(spec.num_experts, dtype=torch.float32), requires_grad=False)
            if spec.router_bias else None
        )
        self.experts = ExpertSet(spec.num_experts, hidden, spec.intermediate_size, act, dtype, spec)
        self.shared = GatedMLP(hidden, spec.shared_intermediate_size, act, dtype) if spec.shared_intermediate_size else None
        self.shared_gate = (
            nn.Parameter(torch.empty(1, hidden, dtype=dtype), requires_grad=False) if spec.shared_gate else None
        )
        # The shared expert's fused gate/up and down as stored codes (quantized checkpoints, one process)
        # and their HF prefix (``...mlp.shared_expert.``): run by its stored linears like a dense MLP's.
        self.stored: dict[str, StoredWeight] = {}
        self.stored_prefix = ""
        # per compute form: the router and the shared expert's gate as the backend's linears, so each
        # row's routing has the same bits alone as in a batch (torch's GEMM picks its summation by M)
        self.gate_ops: dict[str, tuple[Linear, Linear | None]] = {}
        self.tp = SINGLE
        self.shared_here = True  # expert parallel: the (replicated) shared expert adds in on rank 0 only
        self.dispatch = False  # expert parallel under data-parallel attention: tokens go to their experts' ranks

    def shard(self, tp: ParallelGroup, expert_parallel: bool = False) -> None:
        """Tensor parallel (each expert's columns split) or expert parallel (the experts split,
        the shared expert replicated); the router is replicated; one all-reduce sums the parts."""
        if expert_parallel:
            self.experts.shard_experts(tp)
            # under data-parallel attention each rank holds its own tokens: it sends each
            # (token, expert) pair to the expert's rank and computes its tokens' shared expert itself
            self.dispatch = tp.dp_attention
            self.shared_here = tp.first or self.dispatch
        else:
            self.experts.shard_columns(tp)
            self.stored = {}  # (whole projections: the shard runs its dense slices)
            if self.shared is not None:
                self.shared.shard(tp, reduce=False)
        self.tp = tp

    def prepare(self, backend: Backend, stored: dict[str, StoredWeight]) -> None:
        self.experts.prepare(backend)
        if self.shared is not None:
            self.shared.prepare(backend, self.stored)
        if backend.form not in self.gate_ops:
            gate = None if self.shared_gate is None else backend.linear(self.shared_gate, None)
            self.gate_ops[backend.form] = (backend.linear(self.router, self.router_bias), gate)

    def release(self, form: str) -> None:
        self.gate_ops.pop(form, None)
        self.experts.release(form)
        if self.shared is not None:
            self.shared.release(form)

    @property
    def has_stored(self) -> bool:
        return bool(self.experts.stored or self.stored)

    def load_stored(self, stored: Mapping[str, StoredWeight], layer: int) -> None:
        """Take this layer's stored codes (HF names) for the routed experts (``ExpertSet.load_stored``)
        and the shared expert's fused gate/up and down, each where all its parts are stored in one kind
        the CPU kernels execute (W8A8 / W4A4 shared experts stay refused: ``loader``)."""
        prefix, names = expert_names(stored, layer)
        self.experts.load_stored(stored, prefix, names)
        m = f"model.layers.{layer}.mlp."
        self.stored_prefix = next((m + n for n in ("shared_expert.", "shared_experts.") for part in ("gate", "up", "down")
                                   if f"{m}{n}{part}_proj.weight" in stored), "")
        self.stored = {}
        if not self.stored_prefix or self.shared is None or self.tp.size > 1:
            return
        for key, parts in (("gate_up", ("gate_proj", "up_proj")), ("down", ("down_proj",))):
            found = _fuse_rows(*(stored.get(f"{self.stored_prefix}{p}.weight") for p in parts))
            if found is not None:
                self.stored[key] = found

    def release_dense(self, form: str) -> int:
        """After ``form`` is built: the routed experts' dense stacks and the shared expert's dense
        weights that run as stored are dropped, their codes kept once (the kernels' packed blocks).
        Returns the bytes given back."""
        freed = self.experts.release_dense(form)
        ops = None if self.shared is None else self.shared.ops.get(form)
        for key, idx in (("gate_up", 0), ("down", 1)):
            sw = self.stored.get(key)
            if sw is None or ops is None or sw.packed:
                continue
            op, w = ops[idx], getattr(self.shared, key)
            if isinstance(op, KernelLinear) and op.fmt == STORED_KINDS.get(narrowed_kind(sw)):
                freed += w.numel() * w.element_size() + sw.blocks.numel() * sw.blocks.element_size()
                self.stored[key] = StoredWeight(op.fmt.upper(), op.packed, sw.shape, sw.perm, packed=True)
                w.data = released(w.data)
        return freed

    def _route(self, h: torch.Tensor, backend: Backend) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's expert weights and indices ``[T, k]`` (the router in float32)."""
        ops = self.gate_ops.get(backend.form)
        logits = (torch.nn.functional.linear(h.float(), self.router, self.router_bias) if ops is None
                  else ops[0](h.float()))
        weights, idx = route(logits, self.spec, self.bias)
        if self.routed is not None:
            self.routed.append(idx)
        return weights, idx

    def _add_shared(self, out: torch.Tensor, h: torch.Tensor, backend: Backend) -> torch.Tensor:
        assert self.shared is not None
        s = self.shared(h, backend)
        if self.shared_gate is not None:
            ops = self.gate_ops.get(backend.form)
            g = torch.nn.functional.linear(h, self.shared_gate) if ops is None or ops[1] is None else ops[1](h)
            s = torch.sigmoid(g) * s
        return out + s

    def dispatched(self, h: torch.Tensor, backend: Backend) -> torch.Tensor:
        """Expert parallel under data-parallel attention, for this rank's rows ``h``: route them
        here, send each (token, expert) pair to the rank holding the expert (all-to-all), run the
        experts there, send the outputs back (all-to-all), weight and sum them per token; add the
        shared expert. The same routing and experts as ``forward``; the sum runs in rank order."""
        tp, ex, k = self.tp, self.experts, self.spec.top_k
        weights, idx = self._route(h, backend)
        flat = idx.reshape(-1)
        dest = torch.div(flat, ex.num_experts, rounding_mode="floor")  # every rank holds as many experts
        order = torch.argsort(dest, stable=True)
        send = torch.bincount(dest, minlength=tp.size).tolist()
        rows, recv = tp.exchange(h.index_select(0, order // k), send)
        ids, _ = tp.exchange(flat.index_select(0, order), send, recv)
        done = ex(rows, torch.ones(rows.shape[0], 1, device=h.device), ids.unsqueeze(1))
        back, _ = tp.exchange(done, recv, send)
        out = torch.zeros_like(h)
        out.index_add_(0, order // k, back * weights.reshape(-1).index_select(0, order).to(h.dtype).unsqueeze(1))
        if self.shared is not None and h.shape[0]:
            out = self._add_shared(out, h, backend)
        return out

    def forward(self, h: torch.Tensor, backend: Backend, residual: torch.Tensor | None = None) -> torch.Tensor:
        weights, idx = self._route(h, backend)
        out = self.experts(h, weights, idx, backend.form)
        if self.shared is not None and self.shared_here:
            out = self._add_shared(out, h, backend)
        residual = self.tp.residual(residual)
        return self.tp.reduce(out if residual is None else residual + out)


def expert_names(stored: Mapping[str, StoredWeight], layer: int) -> tuple[str, tuple[str, str, str]]:
    """The HF prefix and (gate, up, down) names of layer ``layer``'s routed experts (Mixtral's
    ``block_sparse_moe.experts.{e}.w1`` …, or ``mlp.experts.{e}.gate_proj`` …)."""
    p = f"model.layers.{layer}."
    if f"{p}block_sparse_moe.experts.0.w1.weight" in stored:
        return p + "block_sparse_moe.experts.", ("w1", "w3", "w2")
    return p + "mlp.experts.", ("gate_proj", "up_proj", "down_proj")


def _fuse_rows(*parts: StoredWeight | None) -> StoredWeight | None:
    """``layers.linear.fuse_rows`` where the result is a kind the CPU kernels execute as stored, else None."""
    fused = fuse_rows(parts)
    return fused if fused is not None and fused.kind in STORED_KINDS else None
