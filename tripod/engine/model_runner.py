"""Turns a scheduled step into tensors, runs the model, and hands back logits.

Owns the device, the dtype, the model and the KV pool. Knows nothing of queues or sampling.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch

from tripod.engine.decode_mirror import DecodeMirror
from tripod.engine.kv_pool import KVPool
from tripod.engine.scheduler import ScheduledItem
from tripod.layers.attention import ForwardBatch, PrefillSegment
from tripod.models.llama import LlamaForCausalLM

log = logging.getLogger(__name__)


class ModelRunner:
    """One forward pass per step over a flat batch: single-token items first, then chunks."""

    def __init__(
        self, model: LlamaForCausalLM, pool: KVPool, device: torch.device, use_mirror: bool = True
    ) -> None:
        self.model = model
        self.pool = pool
        self.device = device
        pool_bytes = pool.kv.numel() * pool.kv.element_size()
        # Budget: half the pool's size, at least 64 MiB (small pools still get dense decode).
        budget = max(pool_bytes // 2, 64 << 20)
        self.mirror = DecodeMirror(pool, max_bytes=budget) if use_mirror else None

    def build_batch(self, items: list[ScheduledItem]) -> tuple[ForwardBatch, list[ScheduledItem]]:
        """Lay out ``items`` (decodes first). Returns the batch and the items in the order of
        the logits rows (those that sample)."""
        singles = [it for it in items if it.length == 1 and not it.verify]
        verify_items = [it for it in items if it.verify]
        chunks = [it for it in items if it.length > 1 and not it.verify]
        ids: list[int] = []
        pos: list[int] = []
        out_slots: list[int] = []
        logits_at: list[int] = []
        sampling: list[ScheduledItem] = []

        kv_idx = mask = None
        mirror_buf = None
        if self.mirror is not None:
            if singles:
                order = self.mirror.sync([it.req for it in singles], [it.start for it in singles])
                if order is not None:
                    singles = [singles[i] for i in order]
                    mirror_buf = self.mirror.buf
            else:
                self.mirror.sync([], [])  # nobody decodes: give every row back
        if singles:
            width = max(it.start + 1 for it in singles)
            rows = []
            lens = []
            for it in singles:
                r = it.req
                n = it.start + 1
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
                kv_idx = torch.tensor(rows, dtype=torch.long, device=self.device)
            lens_t = torch.tensor(lens, device=self.device).unsqueeze(1)
            mask = (torch.arange(width, device=self.device).unsqueeze(0) < lens_t)[:, None, None, :]

        # Jump-forward: [last token, drafts...], every position with logits (each predicts the
        # next token), attending position by position like plain decoding.
        verifies = []
        for it in verify_items:
            r = it.req
            first = len(ids)
            for p in range(it.start, it.start + it.length):
                ids.append(r.all_ids[p])
                pos.append(p)
                out_slots.append(r.slots[p])
                logits_at.append(len(ids) - 1)
            sampling.append(it)
            kv = torch.tensor(r.slots[: it.start + it.length], dtype=torch.long, device=self.device)
            verifies.append((first, it.start, it.length, kv))

        segs: list[PrefillSegment] = []
        for it in chunks:
            r = it.req
            s, n = it.start, it.length
            toks = r.all_ids[s : s + n]
            first = len(ids)
            ids.extend(toks)
            pos.extend(range(s, s + n))
            out_slots.extend(r.slots[s : s + n])
            if s == 0:
                segs.append(PrefillSegment(first, n, 0, None, None))
            else:
                kv = torch.tensor(r.slots[: s + n], dtype=torch.long, device=self.device)
                q_pos = torch.arange(s, s + n, device=self.device).unsqueeze(1)
                k_pos = torch.arange(s + n, device=self.device).unsqueeze(0)
                segs.append(PrefillSegment(first, n, s, kv, k_pos <= q_pos))
            if it.samples:
                logits_at.append(len(ids) - 1)
                sampling.append(it)

        batch = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.long, device=self.device),
            positions=torch.tensor(pos, dtype=torch.long, device=self.device),
            out_slots=torch.tensor(out_slots, dtype=torch.long, device=self.device),
            num_decode=len(singles),
            decode_kv_idx=kv_idx,
            decode_mask=mask,
            decode_mirror=mirror_buf,
            prefills=segs,
            logits_idx=torch.tensor(logits_at, dtype=torch.long, device=self.device),
            verifies=verifies,
        )
        return batch, sampling

    def forward(self, items: list[ScheduledItem]) -> tuple[torch.Tensor, list[ScheduledItem]]:
        """Run one step. Returns float32 logits (one row per sampling item, ``length`` rows for a
        ``verify`` item) and the sampling items in row order."""
        batch, sampling = self.build_batch(items)
        logits = self.model(batch, self.pool)
        return logits, sampling

    def prompt_logits(self, ids: list[int], slots: list[int], chunk: int) -> Iterator[tuple[int, torch.Tensor]]:
        """Score a prompt: a forward of its own, outside any step, over ``ids`` in chunks of
        ``chunk`` tokens, writing K/V into ``slots`` (scratch slots the caller owns and frees).
        Yields ``(start, logits)``: float32 logits at every position of ``ids[start:start + n]``
        (row j predicts token ``start + j + 1``)."""
        # NOTE: prompt logprobs need logits at every prompt position, which a step's prefill
        # never computes (and a cached prefix is never recomputed); this separate pass keeps
        # the step path untouched.
        assert len(slots) >= len(ids)
        dev = self.device
        for s in range(0, len(ids), chunk):
            n = min(chunk, len(ids) - s)
            if s == 0:
                seg = PrefillSegment(0, n, 0, None, None)
            else:
                kv = torch.tensor(slots[: s + n], dtype=torch.long, device=dev)
                q_pos = torch.arange(s, s + n, device=dev).unsqueeze(1)
                k_pos = torch.arange(s + n, device=dev).unsqueeze(0)
                seg = PrefillSegment(0, n, s, kv, k_pos <= q_pos)
            batch = ForwardBatch(
                input_ids=torch.tensor(ids[s : s + n], dtype=torch.long, device=dev),
                positions=torch.arange(s, s + n, dtype=torch.long, device=dev),
                out_slots=torch.tensor(slots[s : s + n], dtype=torch.long, device=dev),
                num_decode=0,
                decode_kv_idx=None,
                decode_mask=None,
                prefills=[seg],
                logits_idx=torch.arange(n, dtype=torch.long, device=dev),
            )
            yield s, self.model(batch, self.pool)
