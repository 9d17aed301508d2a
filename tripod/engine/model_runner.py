"""Turns a scheduled step into tensors, runs the model, and hands back logits.

Owns the device, the dtype, the model and the KV pool, and picks the compute backend of each step
(``layers/backends``): the reference backend (``F.linear``, SDPA; float32 op for op with HF), or
on the optimized path tripod's CPU kernels of one ISA level once they are loaded (reading the pool
through the slot table), and torch's packed oneDNN matmuls before (or without) them. The backend
lays the step out (its own attention metadata); this class knows nothing of ISAs, queues or
sampling.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch

from tripod import kernels
from tripod.engine.executor.group import WorkerGroup
from tripod.engine.graphs import DecodeGraphs
from tripod.engine.pooling import Pooler
from tripod.engine.routed_experts import RoutingCapture
from tripod.engine.scheduler import ScheduledItem
from tripod.engine.vision import VisionInputs
from tripod.kernels import gpu
from tripod.layers.backends import CpuBackend, CpuLinearBackend, ReferenceBackend, TorchBackend
from tripod.layers.backends.reference import ScoringBackend, prefill_segment
from tripod.layers.backends.triton import TritonBackend, TritonLinearBackend
from tripod.layers.batch import Backend, BatchContext, ForwardBatch, StateRows
from tripod.layers.linear import onednn_supported
from tripod.layers.lora import LoraAdapter, LoraBatch, LoraPool
from tripod.layers.parallel import DPLayout
from tripod.memory.decode_mirror import DecodeMirror
from tripod.memory.kv_pool import KVPool, Pool
from tripod.memory.slot_table import SlotTable
from tripod.memory.state_pool import StatePool, StateTrace
from tripod.models.llama import LlamaForCausalLM
from tripod.protocol.stats import ParallelCard

log = logging.getLogger(__name__)

# Why neither paged-attention kernel runs Gemma 3's vision model (its projections still do).
BIDIRECTIONAL_IMAGES = "an image's tokens attend to each other both ways (Gemma 3): torch's attention with its masks"


class ModelRunner:
    """One forward pass per step over a flat batch laid out by the step's backend. ``level``: the
    kernels' ISA level (None: the best this CPU supports)."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        pool: Pool,
        device: torch.device,
        use_mirror: bool = True,
        path: str = "eager",
        max_len: int = 0,
        stored: bool = False,
        level: str | None = None,
        group: WorkerGroup | None = None,
        parallel: ParallelCard | None = None,
        lora_pool: LoraPool | None = None,
        triton: bool = False,
        cuda_graphs: bool = True,
        cuda_graph_max_bs: int = 256,
        pooler: Pooler | None = None,
        vision: VisionInputs | None = None,
        states: StatePool | None = None,
        routes: bool = False,
    ) -> None:
        self.model = model
        self.states = states  # a hybrid model's recurrent states (one slot per running request)
        self._scratch: StatePool | None = None  # a hybrid's one state slot for prompt scoring (made on first use)
        self.vision = vision if vision is not None and vision.enabled else None  # each step's image inputs
        # return_routed_experts (engine/routed_experts.py): the engine's own runner only (``routes``),
        # never a draft model's, whose forwards over the same requests must not file their routing.
        self.routing = RoutingCapture(model if routes else None)
        self.pooler = pooler  # --task embed: every forward's last-layer states pooled, nothing sampled
        self.triton = triton  # the Triton kernels (the CUDA backend; on the CPU in Triton's interpreter)
        self.group = group  # tensor parallel: the other ranks, sent every forward (engine/executor)
        self.micro_steps = 0  # pipeline parallel: steps run as several micro-batches
        self.parallel = parallel  # ... and what each rank holds, for the compute card
        self.pool = pool
        self.lora_pool = lora_pool  # the engine's resident LoRA adapters (engine/lora.py)
        self.device = device
        self.path = path
        self.stored = stored
        self.level = level or kernels.best_level()
        pool_bytes = pool.kv.numel() * pool.kv.element_size()
        # Budget: half the pool's size, at least 64 MiB (small pools still get dense decode).
        budget = max(pool_bytes // 2, 64 << 20)
        # The mirror holds K/V rows; a latent (MLA) pool's decodes read the pool itself.
        self.kernel_reason = self._kernel_obstacle()
        self.attention_reason = self._triton_attention_obstacle() if triton else self._attention_obstacle()
        full = (triton or self.kernel_reason is None) and self.attention_reason is None
        mirrored = use_mirror and isinstance(pool, KVPool) and not (triton and full)
        self.mirror = DecodeMirror(pool, max_bytes=budget) if mirrored else None
        self.table = SlotTable(max_len or pool.num_slots, device) if full else None
        self.batch_ctx = BatchContext(device, self.mirror, self.table)  # what the backends lay steps out with
        self._reference = ReferenceBackend()
        self._torch = TorchBackend()
        self._cpu: CpuBackend | CpuLinearBackend | None = None
        self._triton: Backend | None = self._make_triton() if triton else None
        self._backend: Backend | None = None
        # Level-2 sleep (engine/weight_update.py): the weights hold no memory, so nothing may be
        # packed from them until they are loaded again (the engine runs no step meanwhile).
        self.weights_released = False
        self.graphs: DecodeGraphs | None = None  # decode steps as CUDA graphs (Triton backend only)
        # (MoE layers route with data-dependent shapes, which a graph cannot hold; a vision model's
        # decode rows may carry M-RoPE tables a graph's static buffers do not; a hybrid model's
        # decode rows carry their state slots, whose item table a graph would freeze: all run eagerly.)
        if (cuda_graphs and isinstance(self._triton, TritonBackend) and group is None and self.table is not None
                and model.cfg.moe is None and model.cfg.vision is None and model.cfg.hybrid is None):
            self.graphs = DecodeGraphs(lambda b: self.model(b, self.pool), self._triton, self.table.table,
                                       self._triton.block_m[False], device, cuda_graph_max_bs,
                                       fake=device.type != "cuda")
        self.backend  # noqa: B018 - prepare the weights of the first step's backend now, not in a step

    def _make_triton(self) -> Backend:
        why = gpu.unavailable_reason(self.device)
        if why is not None:
            raise ValueError(f"the Triton backend cannot run here: {why}")
        if self.attention_reason is None:
            cfg = self.model.cfg
            return TritonBackend(self.device, cfg.num_heads // cfg.num_kv_heads)
        return TritonLinearBackend(self.device, self.attention_reason)

    def _triton_attention_obstacle(self) -> str | None:
        """Why the Triton paged attention cannot run this model (its norms, activations and, for
        MLA, the absorbed decode still run on Triton: ``TritonLinearBackend``)."""
        cfg = self.model.cfg
        if cfg.vision is not None and cfg.vision.bidirectional:
            return BIDIRECTIONAL_IMAGES
        if cfg.mla is not None:
            return "multi-head latent attention: torch's layout, the decode rows on the Triton MLA kernel"
        if cfg.v4 is not None:
            return "DeepSeek-V4's compressed attention runs on torch's ops"
        if cfg.head_dim < 16 or cfg.num_heads % cfg.num_kv_heads:
            return f"head_dim {cfg.head_dim} / {cfg.num_heads} heads over {cfg.num_kv_heads} is not a shape it covers"
        return None

    def _kernel_obstacle(self) -> str | None:
        """Why this runner can never use the CPU kernels (None: it can, once they are loaded)."""
        if self.triton:
            return "the Triton backend was asked for"
        if self.path != "optimized":
            return "the reference path was asked for"
        if self.device.type != "cpu":
            return f"they are CPU kernels (the device is {self.device})"
        if self.pool.kv.dtype not in (torch.float32, torch.bfloat16):
            return f"{self.pool.kv.dtype} is not a dtype they cover"
        return kernels.unavailable_reason(self.level)

    def _attention_obstacle(self) -> str | None:
        """Why the kernels' paged attention cannot run this model (its projections and norms
        still run on the kernels: ``CpuLinearBackend``)."""
        cfg = self.model.cfg
        if cfg.vision is not None and cfg.vision.bidirectional:
            return BIDIRECTIONAL_IMAGES
        if cfg.mla is not None:
            return "multi-head latent attention runs on torch's ops (latent pool, absorbed decode)"
        if cfg.v4 is not None:
            return "DeepSeek-V4's compressed attention runs on torch's ops"
        if cfg.sliding_window is not None:
            return "sliding-window attention layers run on torch's ops"
        if cfg.attn_softcap is not None:
            return "soft-capped attention runs on torch's ops"
        if cfg.attn_sinks:
            return "attention with sinks runs on torch's ops"
        if cfg.head_dim not in (32, 64, 96, 128, 256) or cfg.num_heads % cfg.num_kv_heads or cfg.num_heads // cfg.num_kv_heads > 8:
            return f"head_dim {cfg.head_dim} / {cfg.num_heads} heads over {cfg.num_kv_heads} is not a shape they cover"
        return None

    @property
    def uses_kernels(self) -> bool:
        """Whether the next step runs wholly on the CPU kernels (attention included)."""
        return self.table is not None and kernels.ready(self.level)

    def _choose(self) -> Backend:
        if self._triton is not None:
            return self._triton
        if self.path != "optimized":
            return self._reference
        if self.kernel_reason is None and kernels.ready(self.level):
            if self._cpu is None:
                assert self.level is not None
                ops = kernels.ops(self.level)
                self._cpu = (CpuBackend(ops, self.level, stored=self.stored) if self.attention_reason is None
                             else CpuLinearBackend(ops, self.level, self.stored, self.attention_reason))
            return self._cpu
        if self.device.type == "cpu" and onednn_supported(self.model.dtype, self.device):
            return self._torch
        return self._reference

    @property
    def backend(self) -> Backend:
        """The backend of the next step, its weights prepared on first use: the kernels once they
        are loaded, torch's packed matmuls before (or without) them."""
        be = self._choose()
        # NOTE: idempotent and cheap once built; called every step because another engine
        # sharing this model may have released a form this one still runs (it is rebuilt).
        if not self.weights_released:
            self.model.prepare(be)
        if self._backend is not be:
            if self._backend is not None:
                log.info("compute path from now on: %s", be.describe())
                if self._backend is self._torch:
                    self.model.release(self._torch.form)  # its packed weights are no longer needed here
            self._backend = be
        return be

    def release_dense_stored(self) -> int:
        """``--weights stored`` on the CPU kernels: build the stored form now and keep only it — each
        projection run as stored codes holds one copy of them (packed for the kernels), no dense
        weight beside it (``LlamaForCausalLM.release_dense_stored``). Returns the bytes given back
        (0 where the next step's backend is not the stored CPU form, or the model keeps no codes)."""
        be = self.backend
        release = getattr(self.model, "release_dense_stored", None)
        if not isinstance(be, (CpuBackend, CpuLinearBackend)) or not be.stored or release is None:
            return 0
        return int(release(be.form))

    def lays_out_slot_table(self) -> bool:
        """Whether the next step's backend lays batches out over the slot table (tripod's CPU
        kernels, the Triton kernels) — a layout that keeps no state between steps."""
        return self.group is None and self.dp_size == 1 and isinstance(self._choose(), (CpuBackend, TritonBackend))

    @property
    def form(self) -> str:
        """The kind of the next step's projections: ``kernel``, ``stored``, ``onednn`` or ``dense``."""
        return self.backend.form.split(":", 1)[0]

    def _why_not_kernels(self) -> str | None:
        why = self.kernel_reason or kernels.unavailable_reason(self.level)  # the build may have failed since
        if why is None and not kernels.ready(self.level):
            return f"tripod's {self.level} CPU kernels are building in the background"
        return why

    def card(self) -> dict[str, Any]:
        """What runs, for ``/v1/models`` and the engine stats: ``{"backend": "cpu", "isa": "avx2"}``,
        or a torch backend with the reason the kernels do not run."""
        be = self.backend
        out = be.card()
        if be.name not in ("cpu", "triton"):
            out["reason"] = self._why_not_kernels()
        if self.parallel is not None:
            out["parallel"] = self.parallel
        return out

    def describe(self) -> str:
        if self._triton is not None:
            return self._triton.describe()
        if self.path != "optimized":
            return "reference (F.linear, SDPA)"
        now = self.backend.describe()
        why = self._why_not_kernels()
        if self.backend.name == "cpu" or why is None:
            return f"optimized: {now}"
        if self.kernel_reason is None and kernels.unavailable_reason(self.level) is None:
            return f"optimized: {now} until tripod's CPU kernels finish building in the background"
        return f"optimized: {now} (tripod CPU kernels unused: {why})"

    @property
    def dp_size(self) -> int:
        """Data-parallel attention: how many ranks each run their own requests' attention (1: none)."""
        return self.group.size if self.group is not None and self.group.tp.dp_attention else 1

    def build_batch(self, items: list[ScheduledItem]) -> tuple[ForwardBatch, list[ScheduledItem]]:
        """Lay out ``items`` for the step's backend. Returns the batch and the items in the order
        of the logits rows (those that sample). Data-parallel attention: one batch per rank (its
        requests' items), rank 0's returned with the others attached (``DPLayout``); the logits
        rows are rank 0's, then rank 1's, ..."""
        stages = self.group.pp.stages if self.group is not None else 1
        if stages > 1 and len(items) > 1:
            return self._micro_batches(items, min(stages, len(items)))
        if self.dp_size == 1:
            batch, sampling = self.backend.build_batch(items, self.batch_ctx)
            batch.lora = lora_rows(batch, self.lora_pool)
            if self.states is not None:
                batch.states = state_rows(batch, self.states)
            if self.vision is not None:
                self.vision.attach(batch, items)  # (encodes the images the step needs first)
            if self.pooler is None:
                return batch, sampling
            # NOTE: an embedding engine runs pooled requests only: none samples (their logits rows are unused)
            assert all(it.req.pooled is not None for it in items), "--task embed generates nothing (EmbedQueue)"
            return batch, []
        backend = self.backend
        batches: list[ForwardBatch] = []
        sampling: list[ScheduledItem] = []
        for rank in range(self.dp_size):
            mine = [it for it in items if it.req.dp_rank == rank]
            batch, rows = backend.build_batch(mine, self.batch_ctx) if mine else (self._empty_batch(backend), [])
            batches.append(batch)
            sampling += rows
        return self._dp_batch(batches), sampling

    def _micro_batches(self, items: list[ScheduledItem], m: int) -> tuple[ForwardBatch, list[ScheduledItem]]:
        """Pipeline parallel: the step's items in ``m`` micro-batches of about equal tokens (so the
        stages overlap), the first carrying the others; logits rows in micro-batch order."""
        backend, total = self.backend, sum(it.length for it in items)
        groups: list[list[ScheduledItem]] = [[]]
        done = 0
        for i, it in enumerate(items):
            left = len(items) - i  # every micro-batch gets at least one item
            if groups[-1] and len(groups) < m and (done >= total * len(groups) / m or left == m - len(groups)):
                groups.append([])
            groups[-1].append(it)
            done += it.length
        built = [backend.build_batch(g, self.batch_ctx) for g in groups]
        self.micro_steps += 1
        first = built[0][0]
        first.micro = [b for b, _ in built[1:]]
        return first, [it for _, rows in built for it in rows]

    def _empty_batch(self, backend: Backend) -> ForwardBatch:
        """A rank's batch when none of its requests is in the step (it still joins the collectives)."""
        none = torch.empty(0, dtype=torch.long, device=self.device)
        return ForwardBatch(input_ids=none, positions=none, out_slots=none, num_decode=0, decode_kv_idx=None,
                            decode_mask=None, logits_idx=none, backend=backend)

    @staticmethod
    def _dp_batch(batches: list[ForwardBatch]) -> ForwardBatch:
        """Rank 0's batch, carrying the layout of the step over every rank and the others' batches."""
        layout = DPLayout(
            rows=tuple(b.input_ids.numel() for b in batches),
            samples=tuple(b.input_ids.numel() if b.logits_idx is None else b.logits_idx.numel() for b in batches),
            ids=torch.cat([b.input_ids for b in batches]),
            others=batches[1:],
        )
        for b in batches:
            b.dp = layout
        return batches[0]

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """The model's forward pass over a built batch: float32 logits for its sampling rows."""
        if self.group is not None:
            self.group.send(batch)
        capturing = self.routing.begin(batch)
        if self.graphs is not None and not capturing and self.graphs.applies(batch):
            return self.graphs.run(batch)
        logits = self.model(batch, self.pool)
        if self.pooler is not None:
            self.pooler.collect(batch)
        if capturing:
            self.routing.collect(batch)
        return logits

    def routing_refusal(self) -> str | None:
        """Why this engine cannot return routed experts (None: it can)."""
        return self.routing.refusal(self.group is not None)

    def scoring_backend(self) -> Backend:
        """Prompt scoring's backend: the projections as the steps run them; attention, norms and
        activations on torch's path (the pass is laid out like the reference's prefill chunks)."""
        backend = self.backend
        return ScoringBackend(backend) if isinstance(backend, (CpuBackend, TritonBackend)) else backend

    def forward(self, items: list[ScheduledItem]) -> tuple[torch.Tensor, list[ScheduledItem]]:
        """Run one step. Returns float32 logits (one row per sampling item, ``length`` rows for a
        ``verify`` item) and the sampling items in row order."""
        batch, sampling = self.build_batch(items)
        return self.run(batch), sampling

    def prompt_logits(self, ids: list[int], slots: list[int], chunk: int,
                      lora: LoraAdapter | None = None) -> Iterator[tuple[int, torch.Tensor]]:
        """Score a prompt: a forward of its own, outside any step, over ``ids`` in chunks of
        ``chunk`` tokens, writing K/V into ``slots`` (scratch slots the caller owns and frees).
        Yields ``(start, logits)``: float32 logits at every position of ``ids[start:start + n]``
        (row j predicts token ``start + j + 1``). ``lora``: the adapter the request runs."""
        # NOTE: prompt logprobs need logits at every prompt position, which a step's prefill
        # never computes (and a cached prefix is never recomputed); this separate pass keeps
        # the step path untouched.
        assert len(slots) >= len(ids)
        scratch = self._scratch_states()
        dev = self.device
        backend = self.scoring_backend()
        for s in range(0, len(ids), chunk):
            n = min(chunk, len(ids) - s)
            batch = ForwardBatch(
                input_ids=torch.tensor(ids[s : s + n], dtype=torch.long, device=dev),
                positions=torch.arange(s, s + n, dtype=torch.long, device=dev),
                out_slots=torch.tensor(slots[s : s + n], dtype=torch.long, device=dev),
                num_decode=0,
                decode_kv_idx=None,
                decode_mask=None,
                prefills=[prefill_segment(0, s, n, slots, dev)],
                logits_idx=torch.arange(n, dtype=torch.long, device=dev),
                backend=backend,
            )
            if scratch is not None:  # a hybrid: the prompt's state from zero, chunk after chunk
                batch.states = StateRows(scratch, [(0, n, 0)])
            if lora is not None:  # (the request's LoRA adapter, on every row)
                batch.lora = LoraBatch(groups=[(lora, torch.arange(n, dtype=torch.long, device=dev))])
            if self.dp_size > 1:  # scored on rank 0 (its slots); the others join with nothing to attend
                batch = self._dp_batch([batch, *(self._empty_batch(backend) for _ in range(self.dp_size - 1))])
            if self.group is not None:
                self.group.send(batch, scoring=True)
            yield s, self.model(batch, self.pool)


    def _scratch_states(self) -> StatePool | None:
        """A hybrid model's scoring state: one slot of its own (never a running request's),
        zeroed, in which the scoring pass runs the prompt's recurrence from its first token.
        NOTE: the pass never starts from a prefix-cache snapshot: it scores every prompt token,
        so it computes every state (as the dense pass computes every K/V into scratch slots)."""
        if self.states is None:
            return None
        if self._scratch is None:
            self._scratch = StatePool(self.states.spec, 1, self.device)
        for layer in self._scratch.tensors:
            for t in layer:
                t.zero_()
        return self._scratch


def state_rows(batch: ForwardBatch, pool: StatePool) -> StateRows:
    """Each item's rows and its request's state slot (a hybrid model's linear layers read them),
    with a ``StateTrace`` over the verify items' slots."""
    items, verifying = [], []
    for it, first in batch.item_rows:
        slot = it.req.state_slot
        assert slot is not None, "a scheduled request of a hybrid model holds a state slot"
        items.append((first, it.length, slot))
        if it.verify:
            verifying.append(slot)
    # NOTE: verify items (drafts) advance the state over rows that may be rejected: the mixers
    # keep the state after each row so the engine can settle on the last accepted one.
    trace = StateTrace(pool, frozenset(verifying)) if verifying else None
    return StateRows(pool, items, trace)


def lora_rows(batch: ForwardBatch, pool: LoraPool | None) -> LoraBatch | None:
    """The batch's rows that run LoRA adapters (None: all the base model): single rows by their
    adapter's pool slot, longer items as runs of rows."""
    rows: list[int] = []
    slots: list[int] = []
    runs: list[tuple[int, int, int]] = []
    for it, first in batch.item_rows:
        adapter = it.req.adapter
        if adapter is None:
            continue
        assert adapter.slot is not None and pool is not None, "a running request's adapter is resident"
        if it.length == 1:
            rows.append(first)
            slots.append(adapter.slot)
        else:
            runs.append((first, it.length, adapter.slot))
    if not rows and not runs:
        return None
    dev = batch.input_ids.device
    tensor = (lambda v: torch.tensor(v, dtype=torch.long, device=dev))  # noqa: E731
    span = (rows[0], len(rows)) if rows and rows == list(range(rows[0], rows[0] + len(rows))) else None
    return LoraBatch(pool=pool, rows=tensor(rows) if rows else None, slots=tensor(slots) if slots else None,
                     runs=runs, span=span, used=max(slots) + 1 if slots else 0)
