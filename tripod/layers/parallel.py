"""Tensor parallelism inside the layers: which rank holds which slice, and the collectives.

A model sharded over ``size`` ranks (``LlamaForCausalLM.shard``) keeps on each rank a slice of
every projection: the Q heads ``[q0, q1)`` with the K/V heads they read (GQA: split, or one head
replicated on several ranks when there are more ranks than K/V heads), the MLP's intermediate
columns (of each expert too), a ``1 / size`` slice of the vocabulary (embedding and LM head). The
column-parallel halves (QKV, gate/up) need no communication; each row-parallel output (O, down,
the experts' sum) is one all-reduce, with the residual (and any output bias) added on rank 0 only
so that it counts once. The vocabulary-parallel embedding is one all-reduce; the LM head's slices
are gathered for the sampler.

``SINGLE`` (one rank) is the identity everywhere: an unsharded model runs exactly as before.
Collectives are torch.distributed's (gloo on CPU, NCCL on CUDA); the group is set up by
``tripod.engine.executor``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch


class CommTime:
    """Seconds this rank spent in collectives, and how many (benchmarks/tensor_parallel.py)."""

    __slots__ = ("calls", "seconds")

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0


@dataclass(frozen=True, slots=True)
class ParallelGroup:
    """This process's place in a tensor-parallel group (``group``: a torch.distributed group;
    None for the default one). ``dp_attention``: data-parallel attention — the attention layers
    stay whole on every rank (each runs its own requests' rows, ``DPLayout``); the MLPs/experts
    and the vocabulary are split over the group as in tensor parallel."""

    rank: int = 0
    size: int = 1
    group: Any = None
    comm: CommTime = field(default_factory=CommTime, compare=False)
    dp_attention: bool = False

    @property
    def first(self) -> bool:
        return self.rank == 0

    def residual(self, residual: torch.Tensor | None) -> torch.Tensor | None:
        """The residual to fuse into a row-parallel output: rank 0's only (it must count once)."""
        return residual if self.rank == 0 else None

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum a row-parallel output over the ranks (in float32: every rank holds the same result)."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        t = time.perf_counter()
        y = x if x.dtype == torch.float32 else x.float()
        dist.all_reduce(y, group=self.group)
        self._count(t)
        return y if y is x else y.to(x.dtype)

    def gather_columns(self, x: torch.Tensor, total: int) -> torch.Tensor:
        """Concatenate each rank's equal-width column slice of ``x`` and keep the first ``total``."""
        if self.size == 1:
            return x[:, :total] if x.shape[1] != total else x
        import torch.distributed as dist

        t = time.perf_counter()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        self._count(t)
        return torch.cat(parts, dim=1)[:, :total]

    def gather_rows(self, x: torch.Tensor, counts: tuple[int, ...]) -> torch.Tensor:
        """Concatenate each rank's rows (rank r holds ``counts[r]`` of them) on every rank."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        most = max(counts)
        if most == 0:
            return x
        t = time.perf_counter()
        padded = x if x.shape[0] == most else torch.cat([x, x.new_zeros(most - x.shape[0], *x.shape[1:])])
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        dist.all_gather(parts, padded.contiguous(), group=self.group)
        self._count(t)
        return torch.cat([p[:n] for p, n in zip(parts, counts, strict=True)])

    def exchange(self, x: torch.Tensor, send: list[int], recv: list[int] | None = None) -> tuple[torch.Tensor, list[int]]:
        """All-to-all: rows ``x[sum(send[:r]) : sum(send[:r+1])]`` go to rank r; returns the rows every
        rank sent here (rank order) and how many came from each (``recv``: known already, e.g. the
        way back)."""
        import torch.distributed as dist

        t = time.perf_counter()
        if recv is None:
            counts = torch.empty(self.size, dtype=torch.int64, device=x.device)
            dist.all_to_all_single(counts, torch.tensor(send, dtype=torch.int64, device=x.device), group=self.group)
            recv = counts.tolist()
        out = x.new_empty(sum(recv), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=self.group)
        self._count(t)
        return out, recv

    def _count(self, since: float) -> None:
        self.comm.seconds += time.perf_counter() - since
        self.comm.calls += 1

    def split(self, n: int, what: str) -> tuple[int, int]:
        """This rank's ``[lo, hi)`` of ``n`` things split evenly (``what`` names them in the error)."""
        if n % self.size:
            raise ValueError(f"tensor parallel size {self.size} must divide the {what} ({n})")
        per = n // self.size
        return self.rank * per, (self.rank + 1) * per

    def padded_split(self, n: int) -> tuple[int, int, int]:
        """``(lo, hi, per)``: this rank's slice of ``n`` rows when every rank holds ``per`` rows
        (the last ones padded): the vocabulary, which rarely divides."""
        per = -(-n // self.size)
        lo = min(n, self.rank * per)
        return lo, min(n, lo + per), per


SINGLE = ParallelGroup()


@dataclass(slots=True)
class DPLayout:
    """One step under data-parallel attention: rank r runs attention for its own ``rows[r]``
    tokens (its requests', whose KV its pool holds) and samples from ``samples[r]`` of them; the
    MLP/MoE layers run on every token of the group (``gather``), the embedding on ``ids`` (all
    ranks' tokens, rank 0's first). ``others``: rank 0's batches for ranks 1.. (never sent)."""

    rows: tuple[int, ...]
    samples: tuple[int, ...]
    ids: torch.Tensor
    others: list[Any] | None = None

    def span(self, rank: int, counts: tuple[int, ...] | None = None) -> tuple[int, int]:
        c = self.rows if counts is None else counts
        lo = sum(c[:rank])
        return lo, lo + c[rank]


def head_split(num_heads: int, num_kv_heads: int, tp: ParallelGroup) -> tuple[int, int, int, int]:
    """``(q0, q1, kv0, kv1)``: the Q heads this rank computes and the K/V heads they read. With more
    ranks than K/V heads, a K/V head is replicated on the ranks whose Q heads share it."""
    q0, q1 = tp.split(num_heads, "number of attention heads")
    if num_kv_heads % tp.size and tp.size % num_kv_heads:
        raise ValueError(f"tensor parallel size {tp.size} and the {num_kv_heads} K/V heads must divide one another")
    group = num_heads // num_kv_heads  # Q heads per K/V head
    return q0, q1, q0 // group, (q1 - 1) // group + 1


def rows(w: torch.Tensor, *spans: tuple[int, int]) -> torch.Tensor:
    """The rows ``spans`` of ``w`` (dim 0, or dim 1 of a stacked ``[E, rows, cols]``), concatenated."""
    dim = 0 if w.dim() < 3 else 1
    return torch.cat([w.narrow(dim, lo, hi - lo) for lo, hi in spans], dim=dim).contiguous()


def columns(w: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Columns ``[lo, hi)`` of ``w`` (its last dim)."""
    return w.narrow(-1, lo, hi - lo).contiguous()


def parameter(t: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(t, requires_grad=False)


@dataclass(frozen=True, slots=True)
class PipeStage:
    """This process's stage of a pipeline: layers ``[first_layer, end_layer)`` of the model. Stage
    0 (the engine's process) embeds the tokens; each stage sends its hidden states to the next;
    the last one computes the logits and sends them back to stage 0, which samples. With tensor
    parallel inside each stage (``width`` ranks a stage), stage s's ranks are ``s * width + lane``:
    each lane is a pipeline of its own (lane l of one stage talks to lane l of the next), the
    all-reduces run among a stage's lanes."""

    stage: int = 0
    stages: int = 1
    lane: int = 0
    width: int = 1

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1

    def rank_of(self, stage: int) -> int:
        """The global rank of this lane's process in ``stage``."""
        return stage * self.width + self.lane

    def layers(self, num_layers: int) -> tuple[int, int]:
        """This stage's layers: an even split, the earlier stages taking one more when it does not divide."""
        if num_layers < self.stages:
            raise ValueError(f"pipeline parallel size {self.stages} exceeds the model's {num_layers} layers")
        per, extra = divmod(num_layers, self.stages)
        lo = self.stage * per + min(self.stage, extra)
        return lo, lo + per + (1 if self.stage < extra else 0)

    def receive(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, stage: int) -> torch.Tensor:
        import torch.distributed as dist

        x = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(x, src=self.rank_of(stage))
        return x

    def post(self, x: torch.Tensor, stage: int) -> Any:
        """Send without waiting (``.wait()`` the result; ``x`` must live until then)."""
        import torch.distributed as dist

        return dist.isend(x, dst=self.rank_of(stage))


SINGLE_STAGE = PipeStage()
