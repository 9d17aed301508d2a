"""Kimi Delta Attention (KDA), Kimi Linear's linear-attention mixer, with an explicit per-sequence
state: a gated delta rule whose decay is per key channel (not per head, as in Gated DeltaNet).

One layer: ``q, k, v`` projections → causal depthwise conv (kernel ``K``, no bias) + SiLU over
their concatenation → per head: ``q, k`` L2-normalised, ``q`` scaled by ``1/sqrt(d)``; the forget
gate ``g = -exp(A_log[h]) · softplus(f_b(f_a(x)) + dt_bias)`` (per channel), ``β = sigmoid(b(x))``
(per head); then per token and head::

    S     = S · exp(g)[:, None]              # S [d_k, d_v]: decay along the key channel
    delta = (v - kᵀS) · β
    S     = S + k ⊗ delta
    o     = qᵀS

→ RMSNorm of ``o`` per head, times ``sigmoid(g_b(g_a(x)))`` → ``o_proj``.

State of one sequence (float32): ``conv`` ``[3·H·d, K - 1]`` (the last ``K - 1`` conv inputs of
``[q | k | v]``, oldest first) and ``rec`` ``[H, d, d]`` (key channel × value channel). Batched:
``[S, 3·H·d, K-1]`` and ``[S, H, d, d]`` (``KdaConfig.state_shapes``, ``new_kda_state``).

NOTE: exactness, as the Mamba2 mixer (``layers/mamba2.py``): a float32 token recurrence of
elementwise ops and row reductions, exp-only transcendentals, the tap-by-tap convolution; so the
result does not depend on how a prefill is split nor on the batch. On tripod's CPU kernels
(``recurrent_kernels``) ``forward_slots`` runs the conv and the recurrence as kernels
(``kernels/csrc/recurrent.cpp``) with the same guarantee.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from tripod.layers.batch import Backend, StateRows
from tripod.layers.linear import Linear, StoredWeight
from tripod.layers.mamba2 import causal_conv, silu_exact, softplus_exact, token_steps, zero_states
from tripod.layers.weights import WeightSource
from tripod.memory.state_pool import StateSpec

# the projections, each prepared per compute form (f_a·f_b and g_a·g_b are low-rank pairs)
PROJECTIONS = ("qkv", "f_a", "f_b", "b", "g_a", "g_b", "o")


@dataclass(frozen=True, slots=True)
class KdaConfig:
    """One KDA layer's geometry."""

    hidden_size: int
    num_heads: int
    head_dim: int
    conv_kernel: int
    eps: float

    @property
    def width(self) -> int:
        return self.num_heads * self.head_dim

    def state_shapes(self) -> tuple[tuple[int, int], tuple[int, int, int]]:
        """(conv window, recurrent state) of one sequence."""
        return (3 * self.width, self.conv_kernel - 1), (self.num_heads, self.head_dim, self.head_dim)

    def state_bytes(self) -> int:
        return StateSpec((self.state_shapes(),)).bytes_per_slot()


def new_kda_state(cfg: KdaConfig, seqs: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, ...]:
    return zero_states(cfg.state_shapes(), seqs, device)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


class KdaMixer(nn.Module):
    """One KDA layer's weights and math; owns no state (the caller's pool does)."""

    def __init__(self, cfg: KdaConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.cfg = cfg
        w, d, h, hid = cfg.width, cfg.head_dim, cfg.num_heads, cfg.hidden_size

        def p(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)

        self.qkv, self.f_a, self.f_b, self.b = p(3 * w, hid), p(d, hid), p(w, d), p(h, hid)
        self.g_a, self.g_b, self.o = p(d, hid), p(w, d), p(hid, w)
        self.conv_w = p(3 * w, cfg.conv_kernel)
        self.dt_bias = nn.Parameter(torch.empty(w, dtype=torch.float32), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(h, dtype=torch.float32), requires_grad=False)
        # A GGUF's ``ssm_a`` (-exp(A_log), float32), used in its place: bit for bit what torch's exp
        # gives, where log() would not give A_log back exactly. None: computed from A_log.
        self.neg_a: torch.Tensor | None = None
        self.o_norm = p(d)
        self.ops: dict[str, dict[str, Linear]] = {}

    def load(self, src: WeightSource, a: str) -> None:
        """transformers' in-memory names under ``a`` (``q_proj``, ``forget_gate.f_a_proj``, one
        ``conv1d`` over ``[q | k | v]``, ...) or the checkpoint files' (Moonshot's: the forget gate's
        tensors directly under ``a``, one ``q_conv1d`` / ``k_conv1d`` / ``v_conv1d`` each)."""
        get = src.get
        fg = a + "forget_gate." if src.has(a + "forget_gate.dt_bias") else a
        self.qkv.data = torch.cat([get(a + n + "_proj.weight") for n in ("q", "k", "v")]).contiguous()
        for mine, theirs in (("f_a", fg + "f_a_proj"), ("f_b", fg + "f_b_proj"), ("b", a + "b_proj"),
                             ("g_a", a + "g_a_proj"), ("g_b", a + "g_b_proj"), ("o", a + "o_proj")):
            getattr(self, mine).data = get(theirs + ".weight").contiguous()
        if src.has(a + "conv1d.weight"):
            conv = get(a + "conv1d.weight")
        else:
            conv = torch.cat([get(f"{a}{n}_conv1d.weight") for n in ("q", "k", "v")])
        self.conv_w.data = conv.reshape(self.conv_w.shape).contiguous()
        self.dt_bias.data = src.get_f32(fg + "dt_bias").reshape(-1)
        if src.has(fg + "A"):  # a GGUF's -exp(A_log) (loader/gguf_kimi.py)
            self.neg_a = src.get_f32(fg + "A").reshape(-1)
        else:
            self.A_log.data = src.get_f32(fg + "A_log").reshape(-1)
        self.o_norm.data = get(a + "o_norm.weight")

    def a(self) -> torch.Tensor:
        """-exp(A_log) per head (a GGUF's stored value when there is one)."""
        return -torch.exp(self.A_log) if self.neg_a is None else self.neg_a

    def prepare(self, backend: Backend, stored: Mapping[str, StoredWeight] | None = None) -> None:
        """``stored``: a GGUF's codes of the projections, by their names here (``PROJECTIONS``)."""
        if backend.form not in self.ops:
            s = stored or {}
            self.ops[backend.form] = {n: backend.linear(getattr(self, n), None, stored=s.get(n)) for n in PROJECTIONS}

    def release(self, form: str) -> None:
        self.ops.pop(form, None)

    def forward(self, h: torch.Tensor, backend: Backend, conv: torch.Tensor, rec: torch.Tensor,
                lens: list[int], residual: torch.Tensor | None = None,
                trace: dict[int, list[torch.Tensor]] | None = None) -> torch.Tensor:
        """``h`` ``[T, hidden]``: the rows of ``len(lens)`` sequences one after another; ``conv`` /
        ``rec`` their states ``[S, ...]``, updated in place. ``trace``: the sequences whose conv
        and recurrent states before and after every row are wanted (appended to their list,
        ``[n + 1, ...]`` each, for speculative verification: ``memory/state_pool.StateTrace``).
        Returns ``[T, hidden]`` (``+ residual``)."""
        c = self.cfg
        t, nh, d = h.shape[0], c.num_heads, c.head_dim
        if sum(lens) != t or len(lens) != conv.shape[0] or len(lens) != rec.shape[0]:
            raise ValueError(f"KDA: {t} rows, {conv.shape[0]}/{rec.shape[0]} states for lengths {lens}")
        op = self.ops[backend.form]
        qkv = silu_exact(causal_conv(op["qkv"](h).float(), conv, lens, self.conv_w.float(), None, trace))
        q, k, v = (part.reshape(t, nh, d) for part in qkv.split(c.width, dim=-1))
        q, k = _l2norm(q) * d**-0.5, _l2norm(k)
        gate = op["f_b"](op["f_a"](h)).float() + self.dt_bias
        decay = torch.exp(self.a()[:, None] * softplus_exact(gate.view(t, nh, d)))  # [T, H, d]
        beta = 1.0 / (1.0 + torch.exp(-op["b"](h).float()))  # [T, H]
        o = self._scan(q, k, v, decay, beta, rec, lens, trace)
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + c.eps) * self.o_norm.float()
        g = op["g_b"](op["g_a"](h)).float().view(t, nh, d)
        o = o / (1.0 + torch.exp(-g))
        return op["o"](o.reshape(t, c.width).to(h.dtype), residual=residual)

    def forward_slots(self, h: torch.Tensor, backend: Backend, states: StateRows, index: int,
                      residual: torch.Tensor | None = None) -> torch.Tensor:
        """``forward`` on a backend with ``recurrent_kernels`` (tripod's CPU kernels): the conv and
        the delta rule (``gated_delta`` with a per-key-channel decay) over the state pool's entry
        ``index`` in place, each item ``(first row, tokens, slot)`` continuing its slot; a traced
        item's per-row states written by the kernels into the step's ``StateTrace``."""
        c = self.cfg
        t, nh, d = h.shape[0], c.num_heads, c.head_dim
        conv, rec = states.pool.tensors[index]
        kept = states.kept_rows()
        conv_keep = (kept.rows, kept.buffer(conv)) if kept is not None else None
        rec_keep = (kept.rows, kept.buffer(rec)) if kept is not None else None
        op = self.ops[backend.form]
        qkv = backend.causal_conv(op["qkv"](h).float(), conv, states.items, self.conv_w, None, keep=conv_keep)
        q, k, v = (part.reshape(t, nh, d) for part in qkv.split(c.width, dim=-1))
        q, k = _l2norm(q) * d**-0.5, _l2norm(k)
        gate = op["f_b"](op["f_a"](h)).float() + self.dt_bias
        decay = torch.exp(self.a()[:, None] * softplus_exact(gate.view(t, nh, d)))  # [T, H, d]
        beta = 1.0 / (1.0 + torch.exp(-op["b"](h).float()))  # [T, H]
        o = backend.gated_delta(q, k, v, decay, beta, rec, states.items, keep=rec_keep)
        if kept is not None and conv_keep is not None and rec_keep is not None:
            kept.put(states, index, [conv_keep[1], rec_keep[1]])
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + c.eps) * self.o_norm.float()
        g = op["g_b"](op["g_a"](h)).float().view(t, nh, d)
        o = o / (1.0 + torch.exp(-g))
        return op["o"](o.reshape(t, c.width).to(h.dtype), residual=residual)

    def _scan(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor,
              rec: torch.Tensor, lens: list[int], trace: dict[int, list[torch.Tensor]] | None = None
              ) -> torch.Tensor:
        """The delta rule, step ``j`` advancing every sequence that has a ``j``-th row at once
        (``trace``: see ``forward``)."""
        out = torch.empty_like(v)
        kept = {s: [rec[s].clone()] for s in trace} if trace else {}
        for j, (rows, idx) in enumerate(token_steps(lens, q.device)):
            state = rec if idx is None else rec.index_select(0, idx)  # (all sequences: in place)
            kj = k.index_select(0, rows)[..., None]  # [S, H, d_k, 1]
            state.mul_(decay.index_select(0, rows)[..., None])
            delta = (v.index_select(0, rows) - (state * kj).sum(-2)) * beta.index_select(0, rows)[..., None]
            state.addcmul_(kj, delta[:, :, None, :])
            out[rows] = (state * q.index_select(0, rows)[..., None]).sum(-2)  # [S, H, d_v]
            if idx is not None:
                rec.index_copy_(0, idx, state)
            for s, states in kept.items():  # (copies of the state this token step produced)
                if lens[s] > j:
                    states.append(rec[s].clone())
        for s, states in kept.items():
            assert trace is not None
            trace[s].append(torch.stack(states))
        return out
