"""Ranks 1..N-1 as processes spawned on this machine, each reached over a pipe (the default
``--parallel-backend``). The group meets through a file store in a temporary directory."""

from __future__ import annotations

import logging
import multiprocessing as mp
import shutil
import signal
import tempfile
from multiprocessing.connection import Connection
from typing import Any

from tripod.config import EngineConfig
from tripod.engine.executor.group import (
    RankStep,
    WorkerGroup,
    WorkerLost,
    WorkerSpec,
    destroy_group,
    init_group,
    threads_per_rank,
)
from tripod.engine.executor.worker import RankWorker
from tripod.protocol.stats import RankCard

log = logging.getLogger(__name__)


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

    def deliver(self, steps: list[RankStep]) -> None:
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
    # NOTE: a signal to the whole process group (Ctrl-C, a service manager's stop) is for the
    # server, which drains and then stops the engine; rank 0 stops this worker (or its pipe closes).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
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
