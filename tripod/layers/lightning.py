"""MiniMax's lightning attention (``MiniMaxForCausalLM``'s linear layers), with an explicit
per-sequence state: a linear attention whose state decays by a fixed per-head rate.

One layer: ``qkv_proj`` → SiLU → per head ``[q | k | v]`` (each ``d`` wide, the head's three side
by side); per token and head, with the head's slope ``λ`` (ALiBi-like: ``base^(h+1)`` scaled down
with the layer's depth)::

    S = exp(-λ) · S + k ⊗ v        # S [d, d]
    o = qᵀS

→ RMSNorm over all heads' outputs together, times ``sigmoid(output_gate(x))`` → ``out_proj``.
No scaling of ``q``, no normalization of ``q``/``k``, no convolution.

State of one sequence (float32): ``kv`` ``[H, d, d]`` (key channel × value channel). Batched
``[S, H, d, d]`` (``LightningConfig.state_shapes``).

NOTE: exactness as the other mixers (``layers/kda.py``): a float32 token recurrence of elementwise
ops and row reductions over the step's sequences, token step by token step (``token_steps``), so a
sequence's state does not depend on how its prefill is split nor on the batch. transformers'
prefill computes the same sums in blocks of ``block_size`` (256): equal to float32 rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tripod.layers.batch import Backend
from tripod.layers.linear import Linear
from tripod.layers.mamba2 import silu_exact, token_steps
from tripod.layers.weights import WeightSource

PROJECTIONS = ("qkv", "gate", "out")


@dataclass(frozen=True, slots=True)
class LightningConfig:
    """One lightning-attention layer's geometry and its place in the model (the slopes depend on it)."""

    hidden_size: int
    num_heads: int
    head_dim: int
    layer: int
    num_layers: int
    eps: float

    @property
    def width(self) -> int:
        return self.num_heads * self.head_dim

    def state_shapes(self) -> tuple[tuple[int, int, int]]:
        return ((self.num_heads, self.head_dim, self.head_dim),)

    def slopes(self) -> torch.Tensor:
        """Each head's decay rate ``λ`` (float32 ``[H]``), as MiniMax computes it."""
        base = 1 / (2 ** (8 / self.num_heads))
        rate = base ** (torch.arange(self.num_heads) + 1)
        return rate * (1 - self.layer / (self.num_layers - 1 + 1e-5) + 1e-5)


class LightningAttention(nn.Module):
    """One lightning-attention layer's weights and math; owns no state (the caller's pool does)."""

    def __init__(self, cfg: LightningConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.cfg = cfg
        w, hid = cfg.width, cfg.hidden_size

        def p(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)

        self.qkv, self.gate, self.out, self.norm_w = p(3 * w, hid), p(w, hid), p(hid, w), p(w)
        # exp(-λ) per head, in float32 as transformers' decode computes it
        self.ratio = torch.exp(-cfg.slopes().float())
        self.ops: dict[str, dict[str, Linear]] = {}

    def load(self, src: WeightSource, a: str) -> None:
        """transformers' names under ``a``: ``qkv_proj``, ``output_gate``, ``out_proj``, ``norm``."""
        self.qkv.data = src.get(a + "qkv_proj.weight").contiguous()
        self.gate.data = src.get(a + "output_gate.weight").contiguous()
        self.out.data = src.get(a + "out_proj.weight").contiguous()
        self.norm_w.data = src.get(a + "norm.weight")
        if src.has(a + "slope_rate"):  # (transformers saves the slopes it computed: the same formula)
            self.ratio = torch.exp(-src.get_f32(a + "slope_rate").reshape(-1))

    def prepare(self, backend: Backend) -> None:
        if backend.form not in self.ops:
            self.ops[backend.form] = {n: backend.linear(getattr(self, n), None) for n in PROJECTIONS}

    def release(self, form: str) -> None:
        self.ops.pop(form, None)

    def forward(self, h: torch.Tensor, backend: Backend, kv: torch.Tensor, lens: list[int],
                residual: torch.Tensor | None = None,
                trace: dict[int, list[torch.Tensor]] | None = None) -> torch.Tensor:
        """``h`` ``[T, hidden]``: the rows of ``len(lens)`` sequences one after another; ``kv`` their
        states ``[S, H, d, d]``, updated in place. ``trace``: the sequences whose states before and
        after every row are wanted (appended to their list, ``[n + 1, H, d, d]``, for speculative
        verification: ``memory/state_pool.StateTrace``). Returns ``[T, hidden]`` (``+ residual``)."""
        c = self.cfg
        t, nh, d = h.shape[0], c.num_heads, c.head_dim
        if sum(lens) != t or len(lens) != kv.shape[0]:
            raise ValueError(f"lightning attention: {t} rows, {kv.shape[0]} states for lengths {lens}")
        op = self.ops[backend.form]
        qkv = silu_exact(op["qkv"](h).float()).view(t, nh, 3, d)  # per head: q, k, v side by side
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        o = self._scan(q, k, v, kv, lens, trace).reshape(t, c.width)
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + c.eps)
        o = self.norm_w.float() * o
        g = op["gate"](h).float()
        o = o / (1.0 + torch.exp(-g))
        return op["out"](o.to(h.dtype), residual=residual)

    def _scan(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor,
              lens: list[int], trace: dict[int, list[torch.Tensor]] | None = None) -> torch.Tensor:
        """The recurrence, step ``j`` advancing every sequence that has a ``j``-th row at once
        (``trace``: see ``forward``)."""
        out = torch.empty_like(v)
        ratio = self.ratio.to(kv.device)[:, None, None]
        kept = {s: [kv[s].clone()] for s in trace} if trace else {}
        for j, (rows, idx) in enumerate(token_steps(lens, q.device)):
            state = kv if idx is None else kv.index_select(0, idx)
            state.mul_(ratio)
            state.addcmul_(k.index_select(0, rows)[..., None], v.index_select(0, rows)[:, :, None, :])
            out[rows] = (state * q.index_select(0, rows)[..., None]).sum(-2)
            if idx is not None:
                kv.index_copy_(0, idx, state)
            for s, states in kept.items():  # (copies of the state this token step produced)
                if lens[s] > j:
                    states.append(kv[s].clone())
        for s, states in kept.items():
            assert trace is not None
            trace[s].append(torch.stack(states))
        return out
