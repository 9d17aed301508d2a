"""Turns a scheduled step into tensors, runs the model, and hands back logits.

Owns the device, the dtype, the model and the KV pool, and picks the compute path of each step:
the optimized path (packed matmuls; tripod's CPU kernels once they are loaded, reading the pool
through the slot table) or the reference path (``F.linear``, SDPA over the decode mirror).
Knows nothing of queues or sampling.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch

from tripod import kernels
from tripod.engine.decode_mirror import DecodeMirror
from tripod.engine.scheduler import ScheduledItem
from tripod.layers.attention import ForwardBatch, KernelMeta, PrefillSegment
from tripod.layers.linear import Form, onednn_supported
from tripod.memory.kv_pool import KVPool, Pool
from tripod.memory.slot_table import SlotTable
from tripod.models.llama import LlamaForCausalLM

log = logging.getLogger(__name__)


class ModelRunner:
    """One forward pass per step over a flat batch: single-token items first, then chunks."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        pool: Pool,
        device: torch.device,
        use_mirror: bool = True,
        path: str = "eager",
        max_len: int = 0,
        stored: bool = False,
    ) -> None:
        self.model = model
        self.pool = pool
        self.device = device
        self.path = path
        self.stored = stored
        pool_bytes = pool.kv.numel() * pool.kv.element_size()
        # Budget: half the pool's size, at least 64 MiB (small pools still get dense decode).
        budget = max(pool_bytes // 2, 64 << 20)
        # The mirror holds K/V rows; a latent (MLA) pool's decodes read the pool itself.
        self.mirror = DecodeMirror(pool, max_bytes=budget) if use_mirror and isinstance(pool, KVPool) else None
        self.kernel_reason = self._kernel_obstacle()
        self.table = SlotTable(max_len or pool.num_slots, device) if self.kernel_reason is None else None
        self._form: Form | None = None
        self.form  # noqa: B018 - prepare the weights of the first step's form now, not in a step

    def _kernel_obstacle(self) -> str | None:
        """Why this runner can never use the CPU kernels (None: it can, once they are loaded)."""
        if self.path != "optimized":
            return "the reference path was asked for"
        if self.device.type != "cpu":
            return f"they are CPU kernels (the device is {self.device})"
        cfg = self.model.cfg
        if cfg.mla is not None:
            return "multi-head latent attention runs on torch's ops (latent pool, absorbed decode)"
        if cfg.sliding_window is not None:
            return "sliding-window attention layers run on torch's ops"
        if cfg.attn_softcap is not None:
            return "soft-capped attention runs on torch's ops"
        if cfg.head_dim not in (32, 64, 96, 128, 256) or cfg.num_heads % cfg.num_kv_heads or cfg.num_heads // cfg.num_kv_heads > 8:
            return f"head_dim {cfg.head_dim} / {cfg.num_heads} heads over {cfg.num_kv_heads} is not a shape they cover"
        if self.pool.kv.dtype not in (torch.float32, torch.bfloat16):
            return f"{self.pool.kv.dtype} is not a dtype they cover"
        return kernels.unavailable_reason()

    @property
    def uses_kernels(self) -> bool:
        """Whether the next step runs on the CPU kernels."""
        return self.table is not None and kernels.ready()

    @property
    def form(self) -> Form:
        """The projections' form for the next step (layers.linear.Form), prepared on first use:
        ``kernel``/``stored`` once the kernels are loaded, ``onednn`` before (or without them)."""
        if self.path != "optimized":
            form: Form = "dense"
        elif self.uses_kernels:
            form = "stored" if self.stored else "kernel"
        elif self.device.type == "cpu" and onednn_supported(self.model.dtype, self.device):
            form = "onednn"
        else:
            form = "dense"
        # NOTE: idempotent and cheap once built; called every step because another engine
        # sharing this model may have released a form this one still runs (it is rebuilt).
        self.model.prepare(form, kernels.ops())
        if form != self._form:
            if self._form is not None:
                log.info("compute path from now on: %s", self.describe_form(form))
                if self._form == "onednn":
                    self.model.release("onednn")  # its packed weights are no longer needed here
            self._form = form
        return form

    @staticmethod
    def describe_form(form: Form) -> str:
        return {
            "kernel": "tripod CPU kernels (linears, attention, norms)",
            "stored": "tripod CPU kernels, GGUF weights executed as stored",
            "onednn": "packed oneDNN matmuls, SDPA",
            "dense": "F.linear, SDPA",
        }[form]

    def describe(self) -> str:
        if self.path != "optimized":
            return "reference (F.linear, SDPA)"
        now = self.describe_form(self.form)
        why = self.kernel_reason or kernels.unavailable_reason()  # the build may have failed since
        if why is not None:
            return f"optimized: {now} (tripod CPU kernels unused: {why})"
        if not kernels.ready():
            return f"optimized: {now} until tripod's CPU kernels finish building in the background"
        return f"optimized: {now}"

    def build_batch(self, items: list[ScheduledItem]) -> tuple[ForwardBatch, list[ScheduledItem]]:
        """Lay out ``items``. Returns the batch and the items in the order of the logits rows
        (those that sample)."""
        if self.uses_kernels:
            return self._build_kernel_batch(items)
        return self._build_torch_batch(items)

    def _build_kernel_batch(self, items: list[ScheduledItem]) -> tuple[ForwardBatch, list[ScheduledItem]]:
        """Every token of the step in item order; each attends its own request's first
        ``position + 1`` keys through the slot table (decodes, drafts and chunks alike)."""
        if self.mirror is not None and self.mirror.buf is not None:
            self.mirror.drop()  # the kernels read the pool directly
        assert self.table is not None
        rows = self.table.sync([(it.req, it.start + it.length) for it in items])
        ids: list[int] = []
        pos: list[int] = []
        out_slots: list[int] = []
        tok_rows: list[int] = []
        logits_at: list[int] = []
        sampling: list[ScheduledItem] = []
        item_rows: list[tuple[ScheduledItem, int]] = []
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
        dev = self.device
        positions = torch.tensor(pos, dtype=torch.long, device=dev)
        meta = KernelMeta(
            table=self.table.table,
            rows=torch.tensor(tok_rows, dtype=torch.int32, device=dev),
            lens=(positions + 1).to(torch.int32),
        )
        all_rows = len(logits_at) == len(ids)  # every token samples (a pure decode step)
        batch = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            positions=positions,
            out_slots=torch.tensor(out_slots, dtype=torch.long, device=dev),
            num_decode=0,
            decode_kv_idx=None,
            decode_mask=None,
            logits_idx=None if all_rows else torch.tensor(logits_at, dtype=torch.long, device=dev),
            kernel=meta,
            kernel_ops=kernels.ops(),
            form=self.form,
            item_rows=item_rows,
        )
        return batch, sampling

    def _build_torch_batch(self, items: list[ScheduledItem]) -> tuple[ForwardBatch, list[ScheduledItem]]:
        """Decodes first (padded together), then verifications, then prefill chunks."""
        singles = [it for it in items if it.length == 1 and not it.verify]
        verify_items = [it for it in items if it.verify]
        chunks = [it for it in items if it.length > 1 and not it.verify]
        ids: list[int] = []
        pos: list[int] = []
        out_slots: list[int] = []
        logits_at: list[int] = []
        sampling: list[ScheduledItem] = []
        item_rows: list[tuple[ScheduledItem, int]] = []

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
                kv_idx = torch.tensor(rows, dtype=torch.long, device=self.device)
            lens_t = torch.tensor(lens, device=self.device).unsqueeze(1)
            mask = (torch.arange(width, device=self.device).unsqueeze(0) < lens_t)[:, None, None, :]

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
            kv = torch.tensor(r.slots[: it.start + it.length], dtype=torch.long, device=self.device)
            verifies.append((first, it.start, it.length, kv))

        segs: list[PrefillSegment] = []
        for it in chunks:
            r = it.req
            s, n = it.start, it.length
            toks = r.all_ids[s : s + n]
            first = len(ids)
            item_rows.append((it, first))
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
            form=self.form,
            item_rows=item_rows,
        )
        return batch, sampling

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """The model's forward pass over a built batch: float32 logits for its sampling rows."""
        return self.model(batch, self.pool)

    def forward(self, items: list[ScheduledItem]) -> tuple[torch.Tensor, list[ScheduledItem]]:
        """Run one step. Returns float32 logits (one row per sampling item, ``length`` rows for a
        ``verify`` item) and the sampling items in row order."""
        batch, sampling = self.build_batch(items)
        return self.run(batch), sampling

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
                form=self.form,  # the projections as the steps run them (attention: torch path)
            )
            yield s, self.model(batch, self.pool)
