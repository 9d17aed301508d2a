"""One model over several processes: a tensor-parallel (or pipeline-parallel) worker group.

The engine's process is rank 0: it runs the scheduler, the radix cache and the sampler once, holds
its own shard of the model (``LlamaForCausalLM.shard``) and its own KV pool (its K/V heads), and
before each forward pass sends the step's built ``ForwardBatch`` (token ids, positions, slot ids,
attention metadata: no K/V data) to ranks 1..T-1. Each worker is a process of its own holding its
shard and a pool of the same slots; it runs the same forward, whose all-reduces (torch.distributed:
gloo on CPU, NCCL on CUDA) keep every rank's hidden states equal; rank 0 gathers the logits.

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
import multiprocessing as mp
import os
import shutil
import socket
import tempfile
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import torch

from tripod.config import EngineConfig
from tripod.layers.batch import ForwardBatch
from tripod.layers.parallel import SINGLE, SINGLE_STAGE, DPLayout, ParallelGroup, PipeStage
from tripod.memory.kv_pool import slots_from_budget
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
class Step:
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
    ``engine/ray_group.RayWorkers`` (Ray actors in a placement group, over the cluster's nodes)."""

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
    def deliver(self, steps: list[Step]) -> None:
        """Hand each worker its step (rank r gets ``steps[r - 1]``)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop the workers and leave the process group."""

    def send(self, batch: ForwardBatch, scoring: bool = False) -> None:
        """Before rank 0's forward: the same forward for every worker (data-parallel attention:
        each its own rows' batch, with the step's layout)."""
        self.check()
        form = batch.backend.form

        def step_of(b: ForwardBatch, dp: DPLayout | None) -> Step:
            return Step(dataclasses.replace(b.detached(), dp=dp), form, scoring)

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


class LocalWorkers(WorkerGroup):
    """Ranks 1..N-1 as processes spawned on this machine, each reached over a pipe; the group meets
    through a file store in a temporary directory."""

    def __init__(self, config: EngineConfig) -> None:
        self.size = config.world_size
        self.timeout = config.parallel_timeout
        self._dir = tempfile.mkdtemp(prefix="tripod-tp-")
        init = f"file://{self._dir}/store"
        ctx = mp.get_context("spawn")
        self.procs: list[Any] = []
        self.conns: list[Connection] = []
        threads = threads_per_rank(config, self.size)
        for rank in range(1, self.size):
            ours, theirs = ctx.Pipe()
            spec = WorkerSpec(config, rank, init, threads, logging.getLogger().level)
            p = ctx.Process(target=worker_main, args=(spec, theirs), name=f"tripod-tp-rank{rank}", daemon=True)
            p.start()
            theirs.close()
            self.procs.append(p)
            self.conns.append(ours)
        self.tp, self.pp = init_group(config, 0, init)
        self.ready: list[RankCard] = []

    def wait_ready(self, budget: int) -> tuple[int, list[RankCard]]:
        num_slots = min([budget, *(self._expect(conn, rank) for rank, conn in enumerate(self.conns, start=1))])
        for conn in self.conns:
            conn.send(num_slots)
        self.ready = [self._expect(conn, rank) for rank, conn in enumerate(self.conns, start=1)]
        return num_slots, self.ready

    def _expect(self, conn: Connection, rank: int) -> Any:
        msg = self._recv(conn, rank)
        if isinstance(msg, BaseException):
            raise WorkerLost(f"tensor-parallel rank {rank} failed to start: {msg}") from msg
        return msg

    def _recv(self, conn: Connection, rank: int) -> Any:
        try:
            return conn.recv()
        except (EOFError, OSError) as e:
            raise WorkerLost(f"tensor-parallel rank {rank} exited while starting "
                             f"(exit code {self.procs[rank - 1].exitcode})") from e

    def check(self) -> None:
        """Raise if a worker has exited (the group cannot run a step without it)."""
        for rank, p in enumerate(self.procs, start=1):
            if not p.is_alive():
                raise WorkerLost(f"tensor-parallel rank {rank} exited (code {p.exitcode}); "
                                 "the group stops and is restarted whole")

    def deliver(self, steps: list[Step]) -> None:
        for rank, (conn, step) in enumerate(zip(self.conns, steps, strict=True), start=1):
            try:
                conn.send(step)
            except (BrokenPipeError, OSError) as e:
                raise WorkerLost(f"tensor-parallel rank {rank} is gone ({e})") from e

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(None)
            except OSError:
                pass
        for p in self.procs:
            p.join(5)
            if p.is_alive():
                p.kill()
        destroy_group()
        shutil.rmtree(self._dir, ignore_errors=True)


def worker_main(spec: WorkerSpec, conn: Connection) -> None:
    """A local rank > 0: join the group, load and shard the model, hold a KV pool, run the forwards
    rank 0 sends until it sends None or goes away."""
    logging.basicConfig(level=spec.log_level, format=f"%(asctime)s %(levelname)s %(name)s[tp{spec.rank}]: %(message)s")
    try:
        worker = RankWorker(spec)
        conn.send(worker.budget)
        conn.send(worker.make_pool(conn.recv()))
    except Exception as e:
        log.exception("tensor-parallel rank %d failed to start", spec.rank)
        conn.send(RuntimeError(f"{type(e).__name__}: {e}"))
        return
    while True:
        try:
            step = conn.recv()
        except (EOFError, OSError):
            return  # rank 0 is gone
        if step is None:
            return
        worker.run(step)


class RankWorker:
    """What a rank > 0 holds, however it is started: its place in the group, its shard of the
    model, then (``make_pool``, once rank 0 has sized the pools) its KV pool and model runner."""

    def __init__(self, spec: WorkerSpec) -> None:
        from tripod.loader import load_model

        torch.set_num_threads(spec.threads)
        self.spec = spec
        config = spec.config
        self.device = config.torch_device()
        self.dtype = config.torch_dtype(self.device)
        self.tp, self.pp = init_group(config, spec.rank, spec.init_method)
        self.loaded = load_model(config.model, self.dtype, self.device, weights=config.weights, tp=self.tp,
                                 expert_parallel=config.enable_expert_parallel, pp=self.pp)
        self.pool_spec = self.loaded.config.pool_spec(self.tp, num_layers=len(self.loaded.model.layers))
        # the slots this rank's memory allows (rank 0 takes the group's smallest)
        self.budget = slots_from_budget(kv_cache_tokens=config.kv_cache_tokens, kv_mem_fraction=config.kv_mem_fraction,
                                        bytes_per_token=self.pool_spec.bytes_per_token(self.dtype), device=self.device,
                                        max_tokens_cap=config.max_kv_cache_tokens)
        self.runner: Any = None

    def make_pool(self, num_slots: int) -> RankCard:
        """A pool of rank 0's ``num_slots`` (every rank holds as many), the kernels, the runner."""
        from tripod.engine.builder import start_kernels
        from tripod.engine.model_runner import ModelRunner

        config, loaded, dtype, device, pool_spec = self.spec.config, self.loaded, self.dtype, self.device, self.pool_spec
        pool = pool_spec.make(num_slots, dtype, device, base=self.spec.rank * num_slots if self.tp.dp_attention else 0)
        path = config.compute_path(dtype)
        start_kernels(dataclasses.replace(config, kernels=config.kernels if config.kernels != "auto" else "optimized")
                      if path == "optimized" else config, path, device)
        context = min(config.max_model_len or loaded.config.max_position_embeddings,
                      loaded.config.max_position_embeddings)
        self.runner = ModelRunner(loaded.model, pool, device, use_mirror=False, path=path,
                                  max_len=min(context, num_slots), stored=config.weights == "stored",
                                  level=config.kernel_level)
        return RankCard(rank=self.spec.rank, weight_bytes=weight_bytes(loaded.model),
                        kv_bytes_per_token=pool_spec.bytes_per_token(dtype), kv_slots=num_slots,
                        node=socket.gethostname())

    def run(self, step: Step) -> None:
        self.runner.run_step(step)
