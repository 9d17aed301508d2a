"""tripod's C++ CPU kernels of one ISA level (``tripod.kernels``): packed linears, RMSNorm,
SiLU·mul, fused RoPE + KV write and paged attention straight from the pool through the slot table
(decode rows, verification rows and prefill chunks alike, every token in item order), and the hybrid
mixers' token recurrences over the state pool's slots (causal conv, gated delta rule, Mamba2 scan)."""

from __future__ import annotations

from typing import Any

import torch

from tripod.layers.activation import activate
from tripod.layers.backends.reference import ReferenceBackend
from tripod.layers.batch import (
    AttnSpec,
    Backend,
    BatchContext,
    ForwardBatch,
    KernelMeta,
    StepItem,
    upload,
)
from tripod.layers.linear import Fp8Scales, Linear, StoredWeight, make_linear
from tripod.layers.rotary import RotaryEmbedding
from tripod.memory.kv_pool import KVPool


class KernelOps:
    """The op families both CPU backends take from the kernels: projections over weights packed
    for them (or GGUF blocks executed as stored), RMSNorm and SiLU·mul (GELU: torch's op), and the
    hybrid mixers' recurrences (``csrc/recurrent.cpp``)."""

    ops: Any
    stored: bool

    def linear(self, weight: torch.Tensor, bias: torch.Tensor | None, *, stored: StoredWeight | None = None,
               fp8: Fp8Scales | None = None) -> Linear:
        return make_linear(weight, bias, "stored" if self.stored else "kernel", ops=self.ops, stored=stored, fp8=fp8)

    def norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self.ops.rms_norm(x, weight, eps)

    def activate(self, gu: torch.Tensor, inter: int, act: str) -> torch.Tensor:
        if act == "silu":
            return self.ops.silu_mul(gu)
        return activate(gu, inter, act)  # GELU has no kernel: torch's op

    # The hybrid mixers' token recurrences as kernels (csrc/recurrent.cpp) over the state pool's
    # slots: one call per layer and step instead of several torch ops per token. Traced items
    # (speculative verification) get their per-row states written by the same call (``keep``).
    recurrent_kernels = True
    # the last item table: every linear layer of a step passes the same ``StateRows.items``
    _items: tuple[list[tuple[int, int, int]], list[int] | None, torch.Tensor] | None = None

    def _item_table(self, items: list[tuple[int, int, int]], keep: tuple[list[int], torch.Tensor] | None
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The kernels' ``[N, 4]`` int64 table (first row, tokens, slot, keep row or -1) and the keep buffer."""
        rows = keep[0] if keep is not None else None
        cached = self._items
        if cached is None or cached[0] is not items or cached[1] != rows:
            table = [(*it, rows[i] if rows is not None else -1) for i, it in enumerate(items)]
            self._items = cached = (items, rows, torch.tensor(table, dtype=torch.int64).view(-1, 4))
        return cached[2], keep[1] if keep is not None else None

    def causal_conv(self, x: torch.Tensor, window: torch.Tensor, items: list[tuple[int, int, int]],
                    weight: torch.Tensor, bias: torch.Tensor | None,
                    keep: tuple[list[int], torch.Tensor] | None = None) -> torch.Tensor:
        if x.dtype not in (torch.float32, torch.bfloat16):
            x = x.float()
        table, buf = self._item_table(items, keep)
        b = bias.float().contiguous() if bias is not None else None
        return self.ops.conv_update(x, window, table, weight.float().contiguous(), b, buf)

    def gated_delta(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor,
                    beta: torch.Tensor, state: torch.Tensor, items: list[tuple[int, int, int]],
                    keep: tuple[list[int], torch.Tensor] | None = None) -> torch.Tensor:
        table, buf = self._item_table(items, keep)
        return self.ops.gated_delta(q.contiguous(), k.contiguous(), v.contiguous(), decay.contiguous(),
                                    beta.contiguous(), state, table, buf)

    def ssd_scan(self, x: torch.Tensor, b: torch.Tensor, c: torch.Tensor, dt: torch.Tensor, decay: torch.Tensor,
                 state: torch.Tensor, items: list[tuple[int, int, int]],
                 keep: tuple[list[int], torch.Tensor] | None = None) -> torch.Tensor:
        table, buf = self._item_table(items, keep)
        return self.ops.ssd_scan(x, b, c, dt.contiguous(), decay.contiguous(), state, table, buf)


class CpuBackend(KernelOps, Backend):
    """The kernels of ``isa`` (``ops``: ``torch.ops.tripod_<isa>``). ``stored``: GGUF weights
    executed as stored where the kernels take their type (``--weights stored``)."""

    name = "cpu"
    wants_rope_rows = False

    def __init__(self, ops: Any, isa: str, stored: bool = False) -> None:
        self.ops, self.isa, self.stored = ops, isa, stored
        # NOTE: the form names the level too: a layer's packed weights hold that library's op.
        self.form = f"{'stored' if stored else 'kernel'}:{isa}"

    def attend(self, qkv: torch.Tensor, layer: int, pool: KVPool, batch: ForwardBatch, rotary: RotaryEmbedding,
               cos_sin: tuple[torch.Tensor, torch.Tensor] | None, spec: AttnSpec) -> torch.Tensor:
        m = batch.kernel
        assert m is not None
        t, d = qkv.shape[0], pool.head_dim
        nh, nkv = spec.num_heads, spec.num_kv_heads
        kv = pool.kv[layer]
        # NOTE: rotates Q and K inside qkv, in place, and copies K|V into the pool slots.
        pos, cos, sin = batch.rope_table or (batch.positions, rotary.cos, rotary.sin)  # (M-RoPE: by row)
        self.ops.rope_store_kv(qkv, pos, cos, sin, kv, batch.out_slots, nh, nkv)
        q = qkv.view(t, -1, d)[:, :nh]
        return self.ops.paged_attention(q, kv, m.table, m.rows, m.lens, spec.scale).view(t, nh * d)

    def build_batch(self, items: list[StepItem], ctx: BatchContext) -> tuple[ForwardBatch, list[StepItem]]:
        return slot_table_batch(self, items, ctx)

    def describe(self) -> str:
        if self.stored:
            return f"tripod CPU kernels, GGUF weights executed as stored ({self.isa})"
        return f"tripod CPU kernels (linears, attention, norms; {self.isa})"


class CpuLinearBackend(KernelOps, ReferenceBackend):
    """tripod's kernels of ``isa`` for the projections, norms and SiLU·mul, with torch's attention
    and step layout: for models whose attention the kernels' paged attention does not cover
    (sliding windows, soft-capped logits, MLA, other head shapes; ``reason`` says which). Gemma 3's
    GGUF with ``--weights stored`` runs here. Not batch-invariant (torch's attention)."""

    name = "cpu"

    def __init__(self, ops: Any, isa: str, stored: bool, reason: str) -> None:
        super().__init__(reason)
        self.ops, self.isa, self.stored = ops, isa, stored
        self.form = f"{'stored' if stored else 'kernel'}:{isa}"

    def card(self) -> dict[str, Any]:
        return {"backend": "cpu", "isa": self.isa, "attention": "torch", "reason": self.reason}

    def describe(self) -> str:
        what = "GGUF weights executed as stored" if self.stored else "linears, norms"
        return f"tripod CPU kernels ({what}; {self.isa}), attention on torch's ops ({self.reason})"


def slot_table_batch(backend: Backend, items: list[StepItem], ctx: BatchContext) -> tuple[ForwardBatch, list[StepItem]]:
    """The step laid out for attention through the slot table (tripod's CPU kernels, the Triton
    kernels): every token of the step in item order; each attends its own request's first
    ``position + 1`` keys through the slot table (decodes, drafts and chunks alike)."""
    if ctx.mirror is not None and ctx.mirror.buf is not None:
        ctx.mirror.drop()  # the kernels read the pool directly
    table = ctx.table
    assert table is not None
    rows = table.sync([(it.req, it.start + it.length) for it in items])
    ids: list[int] = []
    pos: list[int] = []
    out_slots: list[int] = []
    tok_rows: list[int] = []
    logits_at: list[int] = []
    sampling: list[StepItem] = []
    item_rows: list[tuple[StepItem, int]] = []
    for it, row in zip(items, rows, strict=True):
        r = it.req
        s, n = it.start, it.length
        np_ = len(r.prompt_ids)
        item_rows.append((it, len(ids)))
        if n == 1:
            ids.append(r.prompt_ids[s] if s < np_ else r.output_ids[s - np_])
            pos.append(s)
            out_slots.append(r.slots[s])
            tok_rows.append(row)
        else:
            ids.extend(r.all_ids[s : s + n])
            pos.extend(range(s, s + n))
            out_slots.extend(r.slots[s : s + n])
            tok_rows.extend([row] * n)
        if it.verify:  # every position predicts the next token
            logits_at.extend(range(len(ids) - n, len(ids)))
            sampling.append(it)
        elif it.samples:
            logits_at.append(len(ids) - 1)
            sampling.append(it)
    dev = ctx.device
    positions = upload(pos, torch.long, dev)
    meta = KernelMeta(
        table=table.table,
        rows=upload(tok_rows, torch.int32, dev),
        lens=(positions + 1).to(torch.int32),
    )
    all_rows = len(logits_at) == len(ids)  # every token samples (a pure decode step)
    batch = ForwardBatch(
        input_ids=upload(ids, torch.long, dev),
        positions=positions,
        out_slots=upload(out_slots, torch.long, dev),
        num_decode=0,
        decode_kv_idx=None,
        decode_mask=None,
        logits_idx=None if all_rows else upload(logits_at, torch.long, dev),
        kernel=meta,
        backend=backend,
        item_rows=item_rows,
    )
    return batch, sampling
