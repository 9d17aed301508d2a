"""CUDA graphs for decode steps: one graph per batch-size bucket, replayed with the step's inputs
copied into the graph's static buffers.

A decode-only step on the Triton backend (every row one token that samples; no LoRA rows, no
data/pipeline parallel layout) is padded to the next bucket (1, 2, 4, 8, 16, 24, 32, then every
16 up to ``--cuda-graph-max-bs``) and replayed. Every input the kernels read lives in a device
tensor (token ids, positions, KV slots, the slot table's rows, key counts, query blocks), so no
Python number of the step is baked into a graph; a padding row has no KV slot (nothing written)
and no keys (it attends nothing). The graphs share one memory pool. Prefill and mixed steps run
eagerly, as do batches above the largest bucket.

The graph itself is the only GPU-only part: ``FakeGraph`` "captures" by keeping the callable and
"replays" by calling it on the same static buffers, so the bucket, padding and buffer logic runs
(and is tested) on the CPU, in Triton's interpreter. A graph's outputs equal an eager run of the
same padded batch bit for bit.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from tripod.layers.batch import Backend, ForwardBatch, KernelMeta

log = logging.getLogger(__name__)


def buckets(max_bs: int) -> list[int]:
    """The captured batch sizes: 1, 2, 4, 8, 16, 24, 32, 48, 64, ... (every 16) up to ``max_bs``
    (included)."""
    out = [b for b in (1, 2, 4, 8, 16, 24, 32) if b <= max_bs]
    b = 48
    while b <= max_bs:
        out.append(b)
        b += 16
    if out[-1] != max_bs:
        out.append(max_bs)
    return out


def bucket_for(n: int, sizes: list[int]) -> int | None:
    """The smallest bucket holding ``n`` rows (None: more than the largest; run eagerly)."""
    for b in sizes:
        if b >= n:
            return b
    return None


class DecodeGraph(Protocol):
    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor: ...

    def replay(self) -> torch.Tensor: ...


class FakeGraph:
    """The CPU stand-in for a CUDA graph: capture keeps the callable (and runs it once, as a
    capture's warm-up does); replay calls it again over the same static buffers."""

    def __init__(self) -> None:
        self.fn: Callable[[], torch.Tensor] | None = None
        self.replays = 0

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        self.fn = fn
        return fn()

    def replay(self) -> torch.Tensor:
        assert self.fn is not None
        self.replays += 1
        return self.fn()


class CudaGraph:
    """``torch.cuda.CUDAGraph``: warmed up on a side stream, captured into the shared pool."""

    def __init__(self, pool: object) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool
        self.out: torch.Tensor | None = None
        self.replays = 0

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()  # warm-up: Triton's compilation and cuBLAS's workspaces happen outside the capture
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(self.graph, pool=self.pool):
            self.out = fn()
        self.graph.replay()  # a capture records without running: the first step's outputs come from a replay
        return self.out

    def replay(self) -> torch.Tensor:
        assert self.out is not None
        self.graph.replay()
        self.replays += 1
        return self.out


@dataclass
class _Static:
    """One bucket's input buffers, the batch that reads them, and its graph."""

    batch: ForwardBatch
    graph: DecodeGraph


class DecodeGraphs:
    """The decode graphs of one model runner. ``forward`` runs the model over a batch (logits of
    every row); ``table`` is the runner's slot table tensor (its address never changes)."""

    def __init__(self, forward: Callable[[ForwardBatch], torch.Tensor], backend: Backend, table: torch.Tensor,
                 block_m: int, device: torch.device, max_bs: int, fake: bool) -> None:
        self.forward, self.backend, self.table, self.block_m = forward, backend, table, block_m
        self.device = device
        self.sizes = buckets(max_bs)
        self.fake = fake
        self.pool = None if fake else torch.cuda.graph_pool_handle()
        self.static: dict[int, _Static] = {}
        self.replays = 0
        self.eager = 0  # decode steps too large for a graph
        self.disabled = False  # a capture failed: every step runs eagerly

    def applies(self, batch: ForwardBatch) -> bool:
        """Whether ``batch`` is a decode-only step a graph can run."""
        m = batch.kernel
        if self.disabled or m is None or m.blocks is None or batch.logits_idx is not None or batch.lora is not None:
            return False
        if batch.dp is not None or batch.micro or batch.backend is not self.backend:
            return False
        n = batch.input_ids.numel()
        if m.blocks.shape[0] != n or m.block_m != self.block_m:
            return False  # (a verify or prefill item: several tokens in a block)
        if bucket_for(n, self.sizes) is None:
            self.eager += 1
            return False
        return True

    def _buffers(self, bs: int) -> ForwardBatch:
        dev = self.device
        long = torch.zeros(bs, dtype=torch.long, device=dev)
        blocks = torch.stack((torch.arange(bs, dtype=torch.int32, device=dev),
                              torch.ones(bs, dtype=torch.int32, device=dev)), dim=1)
        meta = KernelMeta(table=self.table, rows=torch.zeros(bs, dtype=torch.int32, device=dev),
                          lens=torch.zeros(bs, dtype=torch.int32, device=dev), blocks=blocks, block_m=self.block_m)
        return ForwardBatch(input_ids=long, positions=long.clone(), out_slots=torch.full_like(long, -1), num_decode=0,
                            decode_kv_idx=None, decode_mask=None, backend=self.backend, kernel=meta)

    def _load(self, static: ForwardBatch, batch: ForwardBatch) -> None:
        """The step's inputs into the bucket's buffers; the rest of the rows are padding."""
        n = batch.input_ids.numel()
        m, sm = batch.kernel, static.kernel
        assert m is not None and sm is not None
        static.input_ids[:n].copy_(batch.input_ids)
        static.positions[:n].copy_(batch.positions)
        static.out_slots[:n].copy_(batch.out_slots)
        static.out_slots[n:].fill_(-1)  # a padding row writes no KV
        sm.rows[:n].copy_(m.rows)
        sm.lens[:n].copy_(m.lens)
        sm.lens[n:].fill_(0)  # ... and attends nothing
        static.positions[n:].fill_(0)

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """The step's logits (``[n, vocab]``) from its bucket's graph, captured on first use."""
        n = batch.input_ids.numel()
        bs = bucket_for(n, self.sizes)
        assert bs is not None and batch.kernel is not None
        table = batch.kernel.table
        if table.data_ptr() != self.table.data_ptr() or table.shape != self.table.shape:
            # The slot table grew (a new tensor, maybe more KV splits): the graphs read the old one.
            self.static.clear()
            self.table = table
        st = self.static.get(bs)
        if st is None:
            buf = self._buffers(bs)
            self._load(buf, batch)
            graph: DecodeGraph = FakeGraph() if self.fake else CudaGraph(self.pool)
            try:
                out = graph.capture(lambda: self.forward(buf))
            except Exception:
                # A model whose forward a graph cannot hold (a host sync, a data-dependent shape):
                # decode eagerly from now on, saying why once.
                log.exception("capturing the decode graph of %d rows failed: decode steps run eagerly", bs)
                self.disabled = True
                return self.forward(batch)

            self.static[bs] = _Static(buf, graph)
            log.info("captured the decode graph of %d rows", bs)
            return out[:n].clone()
        self._load(st.batch, batch)
        self.replays += 1
        return st.graph.replay()[:n].clone()

    def padded(self, batch: ForwardBatch) -> ForwardBatch:
        """``batch`` as its bucket's buffers hold it (a copy: for comparing a replay with eager)."""
        bs = bucket_for(batch.input_ids.numel(), self.sizes)
        assert bs is not None
        buf = self._buffers(bs)
        self._load(buf, batch)
        return buf
