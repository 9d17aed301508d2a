"""The executor's common ground: a group of ranks running one model, and what rank 0 sends them.

The engine's process is rank 0: it runs the scheduler, the prefix cache and the sampler once, holds
its own shard of the model (``LlamaForCausalLM.shard``) and its own KV pool (its K/V heads), and
before each forward pass sends the step's built ``ForwardBatch`` (token ids, positions, slot ids,
attention metadata: no K/V data) to ranks 1..N-1 as a ``RankStep``. Each worker
(``executor/worker.py``) is a process of its own holding its shard and a pool of the same slots;
it runs the same forward, whose all-reduces (torch.distributed: gloo on CPU, NCCL on CUDA) keep
every rank's hidden states equal; rank 0 gathers the logits. How workers are started and reached is
a ``WorkerGroup``'s: ``executor/local.py`` (processes spawned here, a pipe each) or
``executor/ray_group.py`` (Ray actors in a placement group).

Faults: a worker that exits is seen before the next step and on the engine's heartbeat
(``check``); one that dies or hangs inside a forward fails the collective (a closed connection at
once, a hang after ``--parallel-timeout``). Either way the engine raises, its process exits, the
server answers 503 and a supervisor relaunches the whole group: a group never limps on without a
rank. Workers exit when rank 0 goes away (their pipe closes).
"""

from __future__ import annotations

import abc
import dataclasses
import logging
import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch

from tripod.config import EngineConfig
from tripod.layers.batch import ForwardBatch
from tripod.layers.parallel import SINGLE, SINGLE_STAGE, DPLayout, ParallelGroup, PipeStage
from tripod.protocol.stats import RankCard

log = logging.getLogger(__name__)


class WorkerLost(RuntimeError):
    """A rank of the group exited or failed: the group cannot compute any more."""


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    config: EngineConfig
    rank: int
    init_method: str
    threads: int
    log_level: int


@dataclass(frozen=True, slots=True)
class RankStep:
    """One forward pass for the workers: the batch (``ForwardBatch.detached``: each worker binds
    its own backend) and how to run it."""

    batch: ForwardBatch
    form: str  # the backend form rank 0 runs (the workers must run the same)
    scoring: bool  # prompt scoring's pass (torch attention over the step's projections)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the distinct parameters a model holds (a tied head counted once)."""
    seen: dict[int, int] = {}
    for p in model.parameters():
        seen[p.data_ptr()] = p.numel() * p.element_size()
    return sum(seen.values())


def resident_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the distinct weight tensors a model holds now: its parameters (a tied head counted
    once), the stored codes it keeps (``StoredWeight.blocks``) and what the compute forms packed
    (``KernelLinear.packed``: the kernels' copy of a dense weight, or the stored codes themselves
    once ``release_dense_stored`` made the two one tensor)."""
    from tripod.layers.linear import KernelLinear, StoredWeight

    seen: dict[int, int] = {}

    def add(t: torch.Tensor) -> None:
        if t.numel() and t.layout == torch.strided:
            seen[t.data_ptr()] = t.numel() * t.element_size()

    for p in model.parameters():
        add(p)
    for module in model.modules():
        stored = getattr(module, "stored", None)
        extra = [module.stored_head] if isinstance(getattr(module, "stored_head", None), StoredWeight) else []
        for sw in [*(stored.values() if isinstance(stored, dict) else ()), *extra]:
            if isinstance(sw, StoredWeight):
                add(sw.blocks)
        for attr in ("ops", "head_ops"):
            forms = getattr(module, attr, None)
            for ops in forms.values() if isinstance(forms, dict) else ():
                for op in ops if isinstance(ops, tuple) else (ops,):
                    if isinstance(op, KernelLinear):
                        add(op.packed)
    return sum(seen.values())


def init_group(config: EngineConfig, rank: int, init_method: str) -> tuple[ParallelGroup, PipeStage]:
    """Join the group as ``rank``; this rank's place: its tensor-parallel slice or its pipeline stage."""
    import torch.distributed as dist

    backend = "nccl" if config.torch_device().type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=config.world_size,
                            timeout=timedelta(seconds=config.parallel_timeout))
    t, p = config.tensor_parallel_size, config.pipeline_parallel_size
    if config.data_parallel_size > 1:  # data-parallel attention: the MLPs and vocabulary split over the D ranks
        return ParallelGroup(rank, config.data_parallel_size, dp_attention=True), SINGLE_STAGE
    stage, lane = divmod(rank, t)
    group = None  # tensor parallel alone: the whole (default) group
    if t > 1 and p > 1:  # each stage's lanes reduce among themselves (every rank makes every group)
        for s in range(p):
            made = dist.new_group([s * t + i for i in range(t)])
            group = made if s == stage else group
    tp = ParallelGroup(lane, t, group=group) if t > 1 else SINGLE
    pp = PipeStage(stage, p, lane, t) if p > 1 else SINGLE_STAGE
    return tp, pp


def threads_per_rank(config: EngineConfig, size: int) -> int:
    """Each rank's torch threads: ``--threads``, else the machine's cores shared out."""
    return config.num_threads or max(1, (os.cpu_count() or 1) // size)


class WorkerGroup(abc.ABC):
    """Ranks 1..N-1 of a group; this process joins it as rank 0. How the workers are started and
    reached is the subclass's: ``LocalWorkers`` (processes spawned here, a pipe each) or
    ``executor/ray_group.RayWorkers`` (Ray actors in a placement group, over the cluster's nodes)."""

    size: int
    timeout: float
    tp: ParallelGroup
    pp: PipeStage
    ready: list[RankCard]
    node: str = socket.gethostname()  # where rank 0 (this process) runs

    @abc.abstractmethod
    def wait_ready(self, budget: int) -> tuple[int, list[RankCard]]:
        """Once every worker has loaded its shard and sized the KV pool its memory allows: the
        group's slot count (the smallest of theirs and rank 0's ``budget``: slot ids address every
        rank's pool alike), each worker's pool made with it, and what each holds."""

    @abc.abstractmethod
    def check(self) -> None:
        """Raise ``WorkerLost`` if a worker is known to be gone (cheap: before every step)."""

    def watch(self) -> None:
        """``check``, and whatever else finds a dead or hung worker while the engine idles (the
        engine's heartbeat calls it)."""
        self.check()

    @abc.abstractmethod
    def deliver(self, steps: list[RankStep]) -> None:
        """Hand each worker its step (rank r gets ``steps[r - 1]``)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop the workers and leave the process group."""

    def send(self, batch: ForwardBatch, scoring: bool = False) -> None:
        """Before rank 0's forward: the same forward for every worker (data-parallel attention:
        each its own rows' batch, with the step's layout)."""
        self.check()
        form = batch.backend.form

        def step_of(b: ForwardBatch, dp: DPLayout | None) -> RankStep:
            return RankStep(dataclasses.replace(b.detached(), dp=dp), form, scoring)

        dp = batch.dp
        if dp is None:
            self.deliver([step_of(batch, None)] * (self.size - 1))
            return
        assert dp.others is not None and len(dp.others) == self.size - 1
        shared = dataclasses.replace(dp, others=None)
        self.deliver([step_of(b, shared) for b in dp.others])


def destroy_group() -> None:
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception as e:
        log.debug("destroying the process group: %s", e)
