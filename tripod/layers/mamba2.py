"""The Mamba2 (SSD) mixer of Nemotron-H and Granite 4.0, with an explicit per-sequence state.

One layer: ``in_proj`` → split into ``z`` (the gate), ``xBC`` and ``dt`` → causal depthwise conv
of ``xBC`` (kernel ``K``) and SiLU → split into ``x`` (heads × head_dim), ``B`` and ``C`` (groups ×
state size) → the selective state-space recurrence per head → ``+ D·x`` → RMSNorm gated by
``silu(z)`` (per group of channels) → ``out_proj``.

State of one sequence (float32 whatever the model's dtype, as the reference keeps it):

- ``conv`` ``[conv_dim, K - 1]``: the last ``K - 1`` inputs of the convolution (``xBC`` before the
  conv, ``conv_dim = heads·head_dim + 2·groups·state``), oldest first: column ``i`` holds token
  ``t - (K - 1) + i`` after token ``t``. Zeros before the first token.
- ``ssm`` ``[heads, head_dim, state]``: the recurrent state ``h`` after the last token.

Batched, the engine stacks them: ``conv`` ``[S, conv_dim, K - 1]``, ``ssm`` ``[S, H, P, N]``
(``Mamba2Config.state_shapes``). A fresh sequence starts from zeros (``new_state``).

The recurrence, per token ``t`` and head ``h`` (``g`` its group)::

    dt   = clamp(softplus(dt_raw + dt_bias), *dt_limit)
    ssm  = ssm · exp(dt · A) + (dt · B[g]) ⊗ x          A = -exp(A_log)
    y    = ssm · C[g] + D · x

NOTE: exactness. The prefill runs this token recurrence in float32 — no chunked SSD — so a
sequence's outputs and final state do not depend on where a prefill chunk starts or ends, nor on
what else is in the batch: every op is elementwise or a reduction along a row, and the
transcendental functions are written with ``exp`` only, whose CPU result does not depend on the
tensor's size (torch's own ``softplus``/``silu``/``sigmoid`` differ by an ulp between their
vectorised body and scalar tail). A decode step is the same step on one token per sequence, so
prefill + decode = one longer prefill, bit for bit. Against Hugging Face's chunked scan the results
agree to float32 rounding (tested at ~1e-5), not bit for bit. On a backend with
``recurrent_kernels`` (tripod's CPU kernels, ``kernels/csrc/recurrent.cpp``; Triton,
``kernels/gpu/recurrent.py``), ``forward_slots`` runs the conv and this recurrence as kernels over
the state pool's slots: the same per-token order, one task per sequence and head, so the same holds
there on one device.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from tripod.layers.batch import Backend, StateRows
from tripod.layers.linear import Linear, StoredWeight
from tripod.layers.weights import WeightSource
from tripod.memory.state_pool import StateSpec

__all__ = ["Mamba2Config", "Mamba2Mixer", "causal_conv", "new_state", "silu_exact", "softplus_exact", "token_steps", "zero_states"]


def softplus_exact(x: torch.Tensor) -> torch.Tensor:
    """``log(1 + exp(x))`` (torch's threshold 20) with the same bits at any tensor size."""
    return torch.where(x > 20.0, x, torch.log1p(torch.exp(x.clamp(max=20.0))))


def silu_exact(x: torch.Tensor) -> torch.Tensor:
    """``x · sigmoid(x)`` with the same bits at any tensor size."""
    return x / (1.0 + torch.exp(-x))


@dataclass(frozen=True, slots=True)
class Mamba2Config:
    """One Mamba2 layer's geometry and options (the same for every Mamba2 layer of a model)."""

    hidden_size: int
    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int
    conv_kernel: int
    eps: float
    conv_bias: bool = True
    proj_bias: bool = False
    dt_limit: tuple[float, float] = (0.0, math.inf)
    activation: str = "silu"

    def __post_init__(self) -> None:
        if self.activation not in ("silu", "swish"):
            raise ValueError(f"Mamba2 layers with activation {self.activation!r} are not supported (only silu)")
        if self.num_heads % self.n_groups:
            raise ValueError(f"Mamba2: {self.num_heads} heads do not split into {self.n_groups} groups")
        if self.conv_kernel < 2:
            raise ValueError(f"Mamba2: conv kernel {self.conv_kernel} < 2")

    @property
    def intermediate(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.intermediate + 2 * self.n_groups * self.state_size

    @property
    def proj_size(self) -> int:
        return self.intermediate + self.conv_dim + self.num_heads

    def state_shapes(self) -> tuple[tuple[int, int], tuple[int, int, int]]:
        """(conv window, ssm state) of one sequence."""
        return (self.conv_dim, self.conv_kernel - 1), (self.num_heads, self.head_dim, self.state_size)

    def state_bytes(self) -> int:
        """Bytes of one sequence's state in one layer (float32)."""
        return StateSpec((self.state_shapes(),)).bytes_per_slot()


def token_steps(lens: list[int], device: torch.device) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
    """A token recurrence's schedule over a flat batch (sequence ``s`` owns ``lens[s]`` consecutive
    rows): step ``j`` gives the rows of every sequence's ``j``-th token and the indices of those
    sequences in the state (None: all of them, so the state is updated in place)."""
    starts = torch.tensor([0, *lens[:-1]], dtype=torch.long).cumsum(0).tolist()
    for j in range(max(lens, default=0)):
        seqs = [s for s, m in enumerate(lens) if m > j]
        rows = torch.tensor([starts[s] + j for s in seqs], dtype=torch.long, device=device)
        yield rows, (None if len(seqs) == len(lens) else torch.tensor(seqs, dtype=torch.long, device=device))


def zero_states(shapes: tuple[tuple[int, ...], ...], seqs: int,
                device: torch.device | str = "cpu") -> tuple[torch.Tensor, ...]:
    """One zero float32 tensor ``[seqs, *shape]`` per shape: ``seqs`` fresh sequences' state."""
    return tuple(torch.zeros(seqs, *shape, dtype=torch.float32, device=device) for shape in shapes)


def new_state(cfg: Mamba2Config, seqs: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, ...]:
    """Zero states for ``seqs`` sequences: conv ``[S, conv_dim, K-1]``, ssm ``[S, H, P, N]`` (float32)."""
    return zero_states(cfg.state_shapes(), seqs, device)


def causal_conv(x: torch.Tensor, window: torch.Tensor, lens: list[int], weight: torch.Tensor,
                bias: torch.Tensor | None, trace: dict[int, list[torch.Tensor]] | None = None) -> torch.Tensor:
    """Causal depthwise convolution of the rows ``x`` ``[T, C]`` of ``len(lens)`` sequences (laid
    out one after another), each continuing from its window ``window[s]`` ``[C, K-1]`` (the last
    ``K-1`` inputs, oldest first; updated in place); ``weight`` ``[C, K]``. Tap by tap: elementwise,
    so a row's bits do not depend on how many rows come with it (``F.conv1d``'s would).
    ``trace``: for the sequences it names, the window before and after each row is appended to
    their list (``[n + 1, C, K-1]``: speculative verification rolls back to one of them)."""
    k = weight.shape[1]
    out = torch.empty_like(x)
    row = 0
    for s, n in enumerate(lens):
        seq = torch.cat((window[s].t(), x[row : row + n]))  # [K - 1 + n, C]
        acc = seq[0:n] * weight[:, 0]
        for j in range(1, k):
            acc = acc + seq[j : j + n] * weight[:, j]
        out[row : row + n] = acc if bias is None else acc + bias
        window[s].copy_(seq[n:].t())
        if trace is not None and s in trace:
            trace[s].append(seq.unfold(0, k - 1, 1).clone())
        row += n
    return out


def _param(*shape: int, dtype: torch.dtype, fill: float | None = None) -> nn.Parameter:
    t = torch.empty(*shape, dtype=dtype) if fill is None else torch.full(shape, fill, dtype=dtype)
    return nn.Parameter(t, requires_grad=False)


class Mamba2Mixer(nn.Module):
    """One Mamba2 layer's weights and its math; owns no state (the caller's pool does)."""

    def __init__(self, cfg: Mamba2Config, dtype: torch.dtype) -> None:
        super().__init__()
        self.cfg = cfg
        c = cfg
        self.in_proj = _param(c.proj_size, c.hidden_size, dtype=dtype)
        self.in_bias = _param(c.proj_size, dtype=dtype, fill=0.0) if c.proj_bias else None
        self.conv_w = _param(c.conv_dim, c.conv_kernel, dtype=dtype)
        self.conv_b = _param(c.conv_dim, dtype=dtype, fill=0.0) if c.conv_bias else None
        self.dt_bias = _param(c.num_heads, dtype=dtype)
        self.A_log = _param(c.num_heads, dtype=dtype)
        self.D = _param(c.num_heads, dtype=dtype)
        self.norm_w = _param(c.intermediate, dtype=dtype, fill=1.0)
        self.out_proj = _param(c.hidden_size, c.intermediate, dtype=dtype)
        self.out_bias = _param(c.hidden_size, dtype=dtype, fill=0.0) if c.proj_bias else None
        # A GGUF's ``ssm_a``: -exp(A_log) as llama.cpp stores it (float32), used in its place (bit for
        # bit what torch's exp gives; log() of it would not give A_log back exactly). None: from A_log.
        self.neg_a: torch.Tensor | None = None
        self.ops: dict[str, tuple[Linear, Linear]] = {}

    def load(self, src: WeightSource, prefix: str) -> None:
        """HF names under ``prefix`` (``...mixer.`` / ``...mamba.``): in_proj, conv1d, dt_bias,
        A_log, D, norm, out_proj."""
        get = src.get
        self.in_proj.data = get(prefix + "in_proj.weight").contiguous()
        self.conv_w.data = get(prefix + "conv1d.weight").reshape(self.cfg.conv_dim, self.cfg.conv_kernel).contiguous()
        if self.conv_b is not None:
            self.conv_b.data = get(prefix + "conv1d.bias")
        if self.in_bias is not None and self.out_bias is not None:
            self.in_bias.data = get(prefix + "in_proj.bias")
            self.out_bias.data = get(prefix + "out_proj.bias")
        self.dt_bias.data = get(prefix + "dt_bias")
        if src.has(prefix + "A"):  # a GGUF's -exp(A_log) (loader/gguf_hybrid.py)
            self.neg_a = src.get_f32(prefix + "A")
        else:
            self.A_log.data = get(prefix + "A_log")
        self.D.data = get(prefix + "D")
        self.norm_w.data = get(prefix + "norm.weight")
        self.out_proj.data = get(prefix + "out_proj.weight").contiguous()

    def prepare(self, backend: Backend, stored: Mapping[str, StoredWeight] | None = None) -> None:
        """``stored``: a GGUF's codes of ``in_proj`` / ``out_proj`` (run as stored on a backend that does)."""
        if backend.form not in self.ops:
            s = stored or {}
            self.ops[backend.form] = (backend.linear(self.in_proj, self.in_bias, stored=s.get("in_proj")),
                                      backend.linear(self.out_proj, self.out_bias, stored=s.get("out_proj")))

    def release(self, form: str) -> None:
        self.ops.pop(form, None)

    def forward(self, h: torch.Tensor, backend: Backend, conv: torch.Tensor, ssm: torch.Tensor,
                lens: list[int], residual: torch.Tensor | None = None,
                trace: dict[int, list[torch.Tensor]] | None = None) -> torch.Tensor:
        """``h`` ``[T, hidden]``: the rows of ``len(lens)`` sequences, one after another
        (sequence ``s`` owns ``lens[s]`` consecutive rows: a decode row has 1, a prefill chunk
        its length). ``conv``/``ssm``: their states ``[S, ...]``, updated in place. ``trace``: the
        sequences whose conv and ssm states before and after every row are wanted (appended to
        their list, ``[n + 1, ...]`` each, for speculative verification). Returns ``[T, hidden]`` (``+ residual``)."""
        in_op, out_op = self.ops[backend.form]
        y = self.mix(in_op(h), conv, ssm, lens, trace)
        return out_op(y.to(h.dtype), residual=residual)

    def forward_slots(self, h: torch.Tensor, backend: Backend, states: StateRows, index: int,
                      residual: torch.Tensor | None = None) -> torch.Tensor:
        """``forward`` on a backend with ``recurrent_kernels``: the state pool's entry ``index``
        (``[slots, ...]`` tensors), each item ``(first row, tokens, slot)`` continuing its slot's
        state in place (no gathered copies); a traced item's per-row states (speculative
        verification) written by the kernels into the step's ``StateTrace``."""
        in_op, out_op = self.ops[backend.form]
        c = self.cfg
        conv, ssm = states.pool.tensors[index]
        items = states.items
        kept = states.kept_rows()
        conv_keep = (kept.rows, kept.buffer(conv)) if kept is not None else None
        ssm_keep = (kept.rows, kept.buffer(ssm)) if kept is not None else None
        zxbcdt = in_op(h).float()
        t = zxbcdt.shape[0]
        z, xbc, dt = zxbcdt.split([c.intermediate, c.conv_dim, c.num_heads], dim=-1)
        xbc = backend.causal_conv(xbc, conv, items, self.conv_w, self.conv_b, keep=conv_keep)
        x, b, cc = xbc.split([c.intermediate, c.n_groups * c.state_size, c.n_groups * c.state_size], dim=-1)
        dt = softplus_exact(dt + self.dt_bias.float()).clamp(min=c.dt_limit[0], max=c.dt_limit[1])  # [T, H]
        decay = torch.exp(dt * self.a())
        y = backend.ssd_scan(x, b, cc, dt, decay, ssm, items, keep=ssm_keep)
        if kept is not None and conv_keep is not None and ssm_keep is not None:
            kept.put(states, index, [conv_keep[1], ssm_keep[1]])
        y = y + x.reshape(t, c.num_heads, c.head_dim) * self.D.float()[:, None]
        return out_op(self._gated_norm(y, z).to(h.dtype), residual=residual)

    def mix(self, zxbcdt: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor, lens: list[int],
            trace: dict[int, list[torch.Tensor]] | None = None) -> torch.Tensor:
        """Everything between the two projections: ``zxbcdt`` ``[T, proj_size]`` → ``[T, heads·head_dim]``
        (float32), states updated in place (see ``forward`` for the row layout)."""
        c = self.cfg
        if sum(lens) != zxbcdt.shape[0] or len(lens) != conv.shape[0] or len(lens) != ssm.shape[0]:
            raise ValueError(f"Mamba2: {zxbcdt.shape[0]} rows, {conv.shape[0]}/{ssm.shape[0]} states for lengths {lens}")
        zxbcdt = zxbcdt.float()
        z, xbc, dt = zxbcdt.split([c.intermediate, c.conv_dim, c.num_heads], dim=-1)
        xbc = self._conv(xbc, conv, lens, trace)
        x, b, cc = xbc.split([c.intermediate, c.n_groups * c.state_size, c.n_groups * c.state_size], dim=-1)
        y = self._scan(x, b, cc, dt, ssm, lens, trace)
        return self._gated_norm(y, z)

    def _conv(self, xbc: torch.Tensor, conv: torch.Tensor, lens: list[int],
              trace: dict[int, list[torch.Tensor]] | None = None) -> torch.Tensor:
        """Causal depthwise conv + SiLU per sequence, from and into its window."""
        b = self.conv_b.float() if self.conv_b is not None else None
        return silu_exact(causal_conv(xbc, conv, lens, self.conv_w.float(), b, trace))

    def _scan(self, x: torch.Tensor, b: torch.Tensor, cc: torch.Tensor, dt: torch.Tensor, ssm: torch.Tensor,
              lens: list[int], trace: dict[int, list[torch.Tensor]] | None = None) -> torch.Tensor:
        """The recurrence, step ``j`` advancing every sequence that has a ``j``-th row at once."""
        c = self.cfg
        t, nh, p, n = x.shape[0], c.num_heads, c.head_dim, c.state_size
        rep = nh // c.n_groups
        dt = softplus_exact(dt + self.dt_bias.float()).clamp(min=c.dt_limit[0], max=c.dt_limit[1])  # [T, H]
        decay = torch.exp(dt * self.a())  # [T, H]
        x = x.view(t, nh, p)
        b = b.view(t, c.n_groups, 1, n).expand(t, c.n_groups, rep, n).reshape(t, nh, 1, n)
        cc = cc.view(t, c.n_groups, 1, n).expand(t, c.n_groups, rep, n).reshape(t, nh, 1, n)
        y = torch.empty_like(x)
        kept = {s: [ssm[s].clone()] for s in trace} if trace else {}
        for j, (rows, idx) in enumerate(token_steps(lens, x.device)):
            state = ssm if idx is None else ssm.index_select(0, idx)  # (all sequences: in place)
            db = dt.index_select(0, rows)[:, :, None, None] * b.index_select(0, rows)  # [S, H, 1, N]
            # NOTE: addcmul_ is fused (one rounding) the same way at every size, scalar tail included.
            state.mul_(decay.index_select(0, rows)[:, :, None, None]).addcmul_(db, x.index_select(0, rows)[..., None])
            # a row reduction, not a matmul: its bits do not depend on how many sequences step together
            y[rows] = (state * cc.index_select(0, rows)).sum(-1)  # [S, H, P]
            if idx is not None:
                ssm.index_copy_(0, idx, state)
            for s, states in kept.items():
                if lens[s] > j:
                    states.append(ssm[s].clone())
        for s, states in kept.items():
            assert trace is not None
            trace[s].append(torch.stack(states))
        return y + x * self.D.float()[:, None]

    def a(self) -> torch.Tensor:
        """``A`` = -exp(A_log) per head, float32 (a GGUF's stored value when there is one)."""
        return -torch.exp(self.A_log.float()) if self.neg_a is None else self.neg_a

    def _gated_norm(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """RMSNorm of ``y · silu(z)`` over each group of ``intermediate / n_groups`` channels."""
        c = self.cfg
        t = y.shape[0]
        g = (y.reshape(t, c.intermediate) * silu_exact(z)).view(t, c.n_groups, -1)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + c.eps)
        return self.norm_w.float() * g.reshape(t, c.intermediate)
