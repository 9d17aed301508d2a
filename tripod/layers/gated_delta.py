"""The gated delta rule mixer (Gated DeltaNet: Qwen3.5, Qwen3-Next), a linear-attention layer.

Per token: one fused projection gives the conv input (Q|K|V channels), the output gate ``z`` and
the per-value-head ``b`` (write strength, ``beta = sigmoid(b)``) and ``a`` (decay,
``g = -exp(A_log) * softplus(a + dt_bias)``); a causal depthwise convolution of width ``K`` over
the last ``K`` conv inputs, then SiLU; Q and K L2-normalized per head (Q also scaled by
``k_dim^-1/2``); then the recurrence over the value heads' states ``S`` (``[k_dim, v_dim]``)::

    S = S * exp(g);  S = S + k ⊗ (beta * (v - kᵀS));  o = qᵀS

and a gated RMSNorm (``w * norm(o) * silu(z)``) before the output projection.

**State layout** (per sequence, per linear layer; float32, ``memory/state_pool.py``):
``conv`` ``[conv_dim, K - 1]`` — the last ``K - 1`` conv inputs, oldest first (zeros before the
first token) — and ``recurrent`` ``[v_heads, k_dim, v_dim]``.

**Exactness.** Every token's update is computed token by token in float32, the same ops in the
same order whatever the step holds: a decode row, a prefill chunk of any length starting
anywhere, alone or beside other sequences. So a sequence's state after token ``n`` does not
depend on how its tokens were split into steps (alone = batched = chunked, bit for bit), and the
conv sums its ``K`` taps in one fixed order for every row. (transformers' prefill uses a chunked
WY form over blocks of 64; the two agree to float32 rounding, and greedy tokens match.) On a
backend with ``recurrent_kernels`` (tripod's CPU kernels, ``kernels/csrc/recurrent.cpp``; Triton,
``kernels/gpu/recurrent.py``) the conv and the recurrence run as kernels over the pool's slots, the
same per-token order in one task per sequence and head, so the same holds there (on one device);
the CPU kernels also write a verify item's per-row states (``StateRows.kept_rows``)."""

from __future__ import annotations

import torch
from torch import nn

from tripod.layers.batch import Backend, StateRows
from tripod.layers.linear import Linear, StoredWeight
from tripod.layers.weights import WeightSource


def _param(*shape: int, dtype: torch.dtype, fill: float | None = None) -> nn.Parameter:
    t = torch.empty(*shape, dtype=dtype) if fill is None else torch.full(shape, fill, dtype=dtype)
    return nn.Parameter(t, requires_grad=False)


class GatedDeltaNet(nn.Module):
    """One gated-delta-rule layer's weights and its forward over a step's rows. ``index``: its
    place among the model's linear layers (its states in the ``StatePool``)."""

    def __init__(self, hidden: int, k_heads: int, v_heads: int, k_dim: int, v_dim: int, kernel: int, eps: float,
                 index: int, dtype: torch.dtype) -> None:
        super().__init__()
        if v_heads % k_heads:
            raise ValueError(f"linear_num_value_heads ({v_heads}) must be a multiple of linear_num_key_heads ({k_heads})")
        self.k_heads, self.v_heads, self.k_dim, self.v_dim = k_heads, v_heads, k_dim, v_dim
        self.kernel, self.eps, self.index = kernel, eps, index
        self.key_size, self.value_size = k_heads * k_dim, v_heads * v_dim
        self.conv_dim = 2 * self.key_size + self.value_size
        # Q|K|V conv inputs, z, b, a: one projection.
        self.in_proj = _param(self.conv_dim + self.value_size + 2 * v_heads, hidden, dtype=dtype)
        self.conv_w = _param(self.conv_dim, kernel, dtype=torch.float32)
        self.dt_bias = _param(v_heads, dtype=torch.float32, fill=1.0)
        self.a_log = _param(v_heads, dtype=torch.float32, fill=0.0)
        self.norm_w = _param(v_dim, dtype=dtype, fill=1.0)
        self.out_proj = _param(hidden, self.value_size, dtype=dtype)
        # A GGUF's ``ssm_a``: -exp(A_log) as llama.cpp stores it, used in its place (bit for bit what
        # torch's exp gives; log() of it would not give A_log back exactly). None: computed from a_log.
        self.neg_a: torch.Tensor | None = None
        self.ops: dict[str, tuple[Linear, Linear]] = {}

    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """This layer's per-sequence state: the conv window and the recurrent state."""
        return ((self.conv_dim, self.kernel - 1), (self.v_heads, self.k_dim, self.v_dim))

    def prepare(self, backend: Backend, stored: dict[str, StoredWeight] | None = None) -> None:
        """``stored``: a GGUF's blocks of ``in_proj`` (Q|K|V|Z|B|A rows) and ``out_proj``, where kept."""
        stored = stored or {}
        if backend.form not in self.ops:
            self.ops[backend.form] = (backend.linear(self.in_proj, None, stored=stored.get("in_proj")),
                                      backend.linear(self.out_proj, None, stored=stored.get("out_proj")))

    def release(self, form: str) -> None:
        self.ops.pop(form, None)

    def load(self, src: WeightSource, p: str) -> None:
        """transformers' names: Qwen3.5's ``in_proj_qkv`` / ``_z`` / ``_b`` / ``_a``, or Qwen3-Next's
        ``in_proj_qkvz`` / ``_ba`` (grouped per key head, reordered here); ``conv1d``, ``A_log``, ..."""
        if src.has(p + "in_proj_qkvz.weight"):
            self.in_proj.data = self._ungroup(src.get(p + "in_proj_qkvz.weight"), src.get(p + "in_proj_ba.weight"))
        else:
            self.in_proj.data = torch.cat([src.get(p + f"in_proj_{n}.weight") for n in ("qkv", "z", "b", "a")]).contiguous()
        self.conv_w.data = src.get_f32(p + "conv1d.weight").reshape(self.conv_dim, self.kernel).contiguous()
        self.dt_bias.data = src.get_f32(p + "dt_bias")
        if src.has(p + "A"):  # a GGUF's -exp(A_log) (loader/gguf_hybrid.py)
            self.neg_a = src.get_f32(p + "A")
        else:
            self.a_log.data = src.get_f32(p + "A_log")
        self.norm_w.data = src.get(p + "norm.weight").contiguous()
        self.out_proj.data = src.get(p + "out_proj.weight").contiguous()

    def _ungroup(self, qkvz: torch.Tensor, ba: torch.Tensor) -> torch.Tensor:
        """Qwen3-Next's rows, per key head ``[q, k, v (r heads), z (r heads)]`` and ``[b (r), a (r)]``
        (r value heads per key head), as this layer's ``[Q | K | V | Z | B | A]``."""
        nk, dk, r, dv = self.k_heads, self.k_dim, self.v_heads // self.k_heads, self.v_dim
        hidden = qkvz.shape[1]
        g = qkvz.view(nk, 2 * dk + 2 * r * dv, hidden)
        q, k = g[:, :dk], g[:, dk : 2 * dk]
        v, z = g[:, 2 * dk : 2 * dk + r * dv], g[:, 2 * dk + r * dv :]
        gb = ba.view(nk, 2 * r, hidden)
        parts = [q, k, v, z, gb[:, :r], gb[:, r:]]
        return torch.cat([t.reshape(-1, hidden) for t in parts]).contiguous()

    def forward(self, h: torch.Tensor, states: StateRows, backend: Backend,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        in_op, out_op = self.ops[backend.form]
        proj = in_op(h)
        c, vs, nv = self.conv_dim, self.value_size, self.v_heads
        mixed = proj[:, :c].float()
        z = proj[:, c : c + vs]
        b = proj[:, c + vs : c + vs + nv]
        a = proj[:, c + vs + nv :]
        conv_state, rec_state = states.pool.tensors[self.index]
        kernels = backend.recurrent_kernels
        kept = states.kept_rows() if kernels else None  # traced items: the kernels write their per-row states
        conv_keep = (kept.rows, kept.buffer(conv_state)) if kept is not None else None
        rec_keep = (kept.rows, kept.buffer(rec_state)) if kept is not None else None
        if kernels:  # the kernel reads the projection's columns in place, in its dtype
            x = backend.causal_conv(proj[:, :c], conv_state, states.items, self.conv_w, None, keep=conv_keep)
        else:
            x = self._conv(mixed, states, conv_state)
        t = x.shape[0]
        q = x[:, : self.key_size].reshape(t, self.k_heads, self.k_dim)
        k = x[:, self.key_size : 2 * self.key_size].reshape(t, self.k_heads, self.k_dim)
        v = x[:, 2 * self.key_size :].reshape(t, nv, self.v_dim)
        rep = nv // self.k_heads
        if rep > 1 and not kernels:  # each Q/K head serves ``rep`` consecutive value heads (the kernel maps them)
            q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
        q = _l2norm(q) * (self.k_dim**-0.5)
        k = _l2norm(k)
        beta = _sigmoid(b).float()
        neg_a = -self.a_log.exp() if self.neg_a is None else self.neg_a
        g = neg_a * _softplus(a.float() + self.dt_bias)
        if kernels:
            o = backend.gated_delta(q, k, v, g.exp(), beta, rec_state, states.items, keep=rec_keep)
            if kept is not None and conv_keep is not None and rec_keep is not None:
                kept.put(states, self.index, [conv_keep[1], rec_keep[1]])
        else:
            o = gated_delta_recurrence(q, k, v, g.exp(), beta, states, rec_state, self.index)
        o = o.to(h.dtype).float()
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.eps)
        o = self.norm_w * o.to(h.dtype)
        o = o * _silu(z.float().reshape(t, nv, self.v_dim))
        return out_op(o.to(h.dtype).reshape(t, vs), residual=residual)

    def _conv(self, mixed: torch.Tensor, states: StateRows, conv_state: torch.Tensor) -> torch.Tensor:
        """The causal conv (+ SiLU) of every row, each item continuing its sequence's window;
        the windows updated in place."""
        out = torch.empty_like(mixed)
        w = self.conv_w
        for first, n, slot in states.items:
            window = torch.cat((conv_state[slot].t(), mixed[first : first + n]))  # [K - 1 + n, C]
            acc = window[0:n] * w[:, 0]
            for j in range(1, self.kernel):  # NOTE: taps summed in one fixed order for every row
                acc = acc + window[j : j + n] * w[:, j]
            out[first : first + n] = acc
            conv_state[slot].copy_(window[n:].t())
            if states.trace is not None and states.trace.wants(slot):
                # the window before and after each row: [n + 1, C, K - 1], oldest first
                states.trace.put(self.index, slot, [window.unfold(0, self.kernel - 1, 1).clone()])
        return _silu(out)


def gated_delta_recurrence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor,
                           states: StateRows, rec_state: torch.Tensor, index: int = 0) -> torch.Tensor:
    """The recurrence, token by token, one sequence at a time: every update is the same
    ``[1, H, Dk, Dv]`` ops whatever else the step holds (torch's reductions may sum a row
    differently when more rows share a call, so rows of different sequences never do). ``index``
    names the layer in a StateTrace. The Triton kernels are checked against this function."""
    out = torch.empty_like(v)
    trace = states.trace
    for first, n, slot in states.items:
        s = rec_state[slot : slot + 1]  # [1, H, Dk, Dv]
        kept = [s.clone()] if trace is not None and trace.wants(slot) else None
        for r in range(first, first + n):
            s = s * decay[r : r + 1, :, None, None]
            kr = k[r : r + 1, :, :, None]
            kv = (s * kr).sum(-2)
            s = s + kr * ((v[r : r + 1] - kv) * beta[r : r + 1, :, None])[:, :, None, :]
            out[r : r + 1] = (s * q[r : r + 1, :, :, None]).sum(-2)
            if kept is not None:
                kept.append(s)  # (a fresh tensor each row: nothing updates it in place)
        rec_state[slot : slot + 1] = s
        if kept is not None:
            assert trace is not None
            trace.put(index, slot, [*trace.rows.pop((index, slot)), torch.cat(kept)])
    return out


# NOTE: torch's CPU sigmoid, SiLU and softplus compute a tensor's last (< 16) elements on a scalar
# path that rounds differently from the vectorized one, so a row's result would depend on where it
# sits in the step's tensor. exp, log, +, / are the same on both paths: these spell the three out
# with them (within 2.4e-7 of torch's).
def _sigmoid(x: torch.Tensor) -> torch.Tensor:
    return 1.0 / (1.0 + torch.exp(-x))


def _silu(x: torch.Tensor) -> torch.Tensor:
    return x / (1.0 + torch.exp(-x))


def _softplus(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x > 20.0, x, torch.log1p(torch.exp(x)))  # (torch's threshold)


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)
