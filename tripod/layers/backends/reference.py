"""torch's ops: the float32 reference (op for op with Hugging Face), and the same with projections
packed once for oneDNN (what serves while tripod's kernels build, or where none can run)."""

from __future__ import annotations

from typing import Any

import torch

from tripod.layers.attention import AttnSpec, ForwardBatch, PrefillSegment, paged_attention
from tripod.layers.backends.base import Backend, StepItem
from tripod.layers.linear import Fp8Scales, Linear, StoredWeight, make_linear
from tripod.layers.mlp import activate
from tripod.layers.norm import rms_norm
from tripod.layers.rotary import RotaryEmbedding, apply_rotary


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

    def attend(self, qkv: torch.Tensor, layer: int, pool: Any, batch: ForwardBatch, rotary: RotaryEmbedding,
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

    def build_batch(self, items: list[StepItem], ctx: Any) -> tuple[ForwardBatch, list[StepItem]]:
        dev = ctx.device
        singles = [it for it in items if it.length == 1 and not it.verify]
        verify_items = [it for it in items if it.verify]
        chunks = [it for it in items if it.length > 1 and not it.verify]
        ids: list[int] = []
        pos: list[int] = []
        out_slots: list[int] = []
        logits_at: list[int] = []
        sampling: list[StepItem] = []
        item_rows: list[tuple[StepItem, int]] = []

        kv_idx = mask = None
        mirror_buf = None
        mirror = ctx.mirror
        if mirror is not None:
            if singles:
                order = mirror.sync([it.req for it in singles], [it.start for it in singles])
                if order is not None:
                    singles = [singles[i] for i in order]
                    mirror_buf = mirror.buf
            else:
                mirror.sync([], [])  # nobody decodes: give every row back
        if singles:
            width = max(it.start + 1 for it in singles)
            rows = []
            lens = []
            for it in singles:
                r = it.req
                n = it.start + 1
                item_rows.append((it, len(ids)))
                ids.append(r.all_ids[it.start])
                pos.append(it.start)
                out_slots.append(r.slots[it.start])
                if mirror_buf is None:
                    rows.append(r.slots[:n] + [0] * (width - n))
                lens.append(n)
                if it.samples:
                    logits_at.append(len(ids) - 1)
                    sampling.append(it)
            if mirror_buf is None:
                kv_idx = torch.tensor(rows, dtype=torch.long, device=dev)
            lens_t = torch.tensor(lens, device=dev).unsqueeze(1)
            mask = (torch.arange(width, device=dev).unsqueeze(0) < lens_t)[:, None, None, :]

        # Jump-forward: [last token, drafts...], every position with logits (each predicts the
        # next token), attending position by position like plain decoding.
        verifies = []
        for it in verify_items:
            r = it.req
            first = len(ids)
            item_rows.append((it, first))
            for p in range(it.start, it.start + it.length):
                ids.append(r.all_ids[p])
                pos.append(p)
                out_slots.append(r.slots[p])
                logits_at.append(len(ids) - 1)
            sampling.append(it)
            kv = torch.tensor(r.slots[: it.start + it.length], dtype=torch.long, device=dev)
            verifies.append((first, it.start, it.length, kv))

        segs: list[PrefillSegment] = []
        for it in chunks:
            r = it.req
            s, n = it.start, it.length
            first = len(ids)
            item_rows.append((it, first))
            ids.extend(r.all_ids[s : s + n])
            pos.extend(range(s, s + n))
            out_slots.extend(r.slots[s : s + n])
            segs.append(prefill_segment(first, s, n, r.slots, dev))
            if it.samples:
                logits_at.append(len(ids) - 1)
                sampling.append(it)

        batch = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            positions=torch.tensor(pos, dtype=torch.long, device=dev),
            out_slots=torch.tensor(out_slots, dtype=torch.long, device=dev),
            num_decode=len(singles),
            decode_kv_idx=kv_idx,
            decode_mask=mask,
            decode_mirror=mirror_buf,
            prefills=segs,
            logits_idx=torch.tensor(logits_at, dtype=torch.long, device=dev),
            verifies=verifies,
            backend=self,
            item_rows=item_rows,
        )
        return batch, sampling

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
