"""torch's ops: the float32 reference (op for op with Hugging Face), and the same with projections
packed once for oneDNN (what serves while tripod's kernels build, or where none can run)."""

from __future__ import annotations

import torch

from tripod.layers.activation import activate
from tripod.layers.attention import paged_attention
from tripod.layers.batch import (
    AttnSpec,
    Backend,
    BatchContext,
    ForwardBatch,
    PrefillSegment,
    StepItem,
)
from tripod.layers.linear import Fp8Scales, Linear, StoredWeight, make_linear
from tripod.layers.norm import rms_norm
from tripod.layers.rotary import RotaryEmbedding, apply_rotary
from tripod.memory.kv_pool import KVPool


class ReferenceBackend(Backend):
    """``F.linear``, torch's RMSNorm and activations, SDPA over the decode mirror or gathered
    K/V. Decodes first (padded together), then verifications, then prefill chunks."""

    name = "reference"
    form = "dense"

    def __init__(self, reason: str | None = None) -> None:
        self.reason = reason

    def linear(self, weight: torch.Tensor, bias: torch.Tensor | None, *, stored: StoredWeight | None = None,
               fp8: Fp8Scales | None = None) -> Linear:
        return make_linear(weight, bias, self.form, fp8=fp8)

    def norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def activate(self, gu: torch.Tensor, inter: int, act: str) -> torch.Tensor:
        return activate(gu, inter, act)

    def attend(self, qkv: torch.Tensor, layer: int, pool: KVPool, batch: ForwardBatch, rotary: RotaryEmbedding,
               cos_sin: tuple[torch.Tensor, torch.Tensor] | None, spec: AttnSpec) -> torch.Tensor:
        assert cos_sin is not None
        t = qkv.shape[0]
        nh, nkv = spec.num_heads, spec.num_kv_heads
        heads = qkv.reshape(t, -1, pool.head_dim)
        # Q and K heads are adjacent in the fused output: rotate them in one pass.
        qk = apply_rotary(heads[:, : nh + nkv], *cos_sin)
        q, k = qk[:, :nh], qk[:, nh:]
        v = heads[:, nh + nkv :]
        return paged_attention(q, k, v, layer, pool, batch, spec).view(t, nh * pool.head_dim)

    def build_batch(self, items: list[StepItem], ctx: BatchContext) -> tuple[ForwardBatch, list[StepItem]]:
        rows = _Rows(ctx.device)
        singles = [it for it in items if it.length == 1 and not it.verify]
        mirror_buf = None
        if ctx.mirror is not None:
            if singles:
                order = ctx.mirror.sync([it.req for it in singles], [it.start for it in singles])
                if order is not None:
                    singles = [singles[i] for i in order]
                    mirror_buf = ctx.mirror.buf
            else:
                ctx.mirror.sync([], [])  # nobody decodes: give every row back
        kv_idx, mask = rows.add_decodes(singles, dense=mirror_buf is None)
        rows.add_verifies([it for it in items if it.verify])
        rows.add_chunks([it for it in items if it.length > 1 and not it.verify])
        dev = ctx.device
        batch = ForwardBatch(
            input_ids=torch.tensor(rows.ids, dtype=torch.long, device=dev),
            positions=torch.tensor(rows.pos, dtype=torch.long, device=dev),
            out_slots=torch.tensor(rows.out_slots, dtype=torch.long, device=dev),
            num_decode=len(singles),
            decode_kv_idx=kv_idx,
            decode_mask=mask,
            decode_mirror=mirror_buf,
            prefills=rows.segs,
            logits_idx=torch.tensor(rows.logits_at, dtype=torch.long, device=dev),
            verifies=rows.verifies,
            backend=self,
            item_rows=rows.item_rows,
        )
        return batch, rows.sampling

    def describe(self) -> str:
        return "reference (F.linear, SDPA)"


def prefill_segment(first: int, start: int, n: int, slots: list[int], dev: torch.device) -> PrefillSegment:
    """A prefill chunk of ``n`` tokens from position ``start`` at flat row ``first``: from 0 it
    attends itself causally; after a cached prefix, the prefix's slots and a causal mask."""
    if start == 0:
        return PrefillSegment(first, n, 0, None, None)
    kv = torch.tensor(slots[: start + n], dtype=torch.long, device=dev)
    q_pos = torch.arange(start, start + n, device=dev).unsqueeze(1)
    k_pos = torch.arange(start + n, device=dev).unsqueeze(0)
    return PrefillSegment(first, n, start, kv, k_pos <= q_pos)


class TorchBackend(ReferenceBackend):
    """torch's ops with every projection packed once for oneDNN (where oneDNN takes the dtype on
    this CPU; plain ``F.linear`` elsewhere and on CUDA)."""

    name = "torch"
    form = "onednn"


class ScoringBackend(ReferenceBackend):
    """torch's attention, norms and activations over another backend's prepared projections: a
    pass laid out outside the steps (prompt scoring) that still projects as the steps do."""

    def __init__(self, linears: Backend) -> None:
        super().__init__()
        self.linears = linears
        self.name, self.isa, self.form = linears.name, linears.isa, linears.form

    def linear(self, weight: torch.Tensor, bias: torch.Tensor | None, *, stored: StoredWeight | None = None,
               fp8: Fp8Scales | None = None) -> Linear:
        return self.linears.linear(weight, bias, stored=stored, fp8=fp8)

    def describe(self) -> str:
        return "packed oneDNN matmuls, SDPA"


REFERENCE = ReferenceBackend()


class _Rows:
    """A step's token rows as the reference backend lays them out: decodes first, then the verify
    items, then the prefill chunks; which rows get logits, and the items that sample."""

    def __init__(self, dev: torch.device) -> None:
        self.dev = dev
        self.ids: list[int] = []
        self.pos: list[int] = []
        self.out_slots: list[int] = []
        self.logits_at: list[int] = []
        self.sampling: list[StepItem] = []
        self.item_rows: list[tuple[StepItem, int]] = []
        self.verifies: list[tuple[int, int, int, torch.Tensor]] = []
        self.segs: list[PrefillSegment] = []

    def _row(self, it: StepItem, p: int) -> None:
        self.ids.append(it.req.all_ids[p])
        self.pos.append(p)
        self.out_slots.append(it.req.slots[p])

    def add_decodes(self, singles: list[StepItem], dense: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """One row per decode; ``dense``: also the padded slot table (else the decode mirror has it)."""
        if not singles:
            return None, None
        width = max(it.start + 1 for it in singles)
        table, lens = [], []
        for it in singles:
            n = it.start + 1
            self.item_rows.append((it, len(self.ids)))
            self._row(it, it.start)
            if dense:
                table.append(it.req.slots[:n] + [0] * (width - n))
            lens.append(n)
            if it.samples:
                self.logits_at.append(len(self.ids) - 1)
                self.sampling.append(it)
        kv_idx = torch.tensor(table, dtype=torch.long, device=self.dev) if dense else None
        lens_t = torch.tensor(lens, device=self.dev).unsqueeze(1)
        mask = (torch.arange(width, device=self.dev).unsqueeze(0) < lens_t)[:, None, None, :]
        return kv_idx, mask

    def add_verifies(self, items: list[StepItem]) -> None:
        """Jump-forward: [last token, drafts...], every position with logits (each predicts the
        next token), attending position by position like plain decoding."""
        for it in items:
            first = len(self.ids)
            self.item_rows.append((it, first))
            for p in range(it.start, it.start + it.length):
                self._row(it, p)
                self.logits_at.append(len(self.ids) - 1)
            self.sampling.append(it)
            kv = torch.tensor(it.req.slots[: it.start + it.length], dtype=torch.long, device=self.dev)
            self.verifies.append((first, it.start, it.length, kv))

    def add_chunks(self, items: list[StepItem]) -> None:
        for it in items:
            r, s, n = it.req, it.start, it.length
            first = len(self.ids)
            self.item_rows.append((it, first))
            self.ids.extend(r.all_ids[s : s + n])
            self.pos.extend(range(s, s + n))
            self.out_slots.extend(r.slots[s : s + n])
            self.segs.append(prefill_segment(first, s, n, r.slots, self.dev))
            if it.samples:
                self.logits_at.append(len(self.ids) - 1)
                self.sampling.append(it)
