"""A model's ranks 1..N-1 as Ray actors, placed over the nodes of a Ray cluster (``--parallel-backend ray``).

Ray places and supervises the workers; torch.distributed still carries the collectives (gloo on
CPU, NCCL on CUDA), meeting over TCP at rank 0's node address. A placement group holds one bundle
per worker (its CPUs, and a GPU on CUDA), packed onto as few nodes as possible or spread over as
many (``--parallel-placement``); every worker is an actor in its bundle running a ``RankWorker``.
Each step rank 0 calls every actor's ``run`` with its ``RankStep`` (a Ray actor runs one caller's calls
in order); the collectives inside the forward keep the ranks in step.

Faults: a step whose actor failed or died is seen when its result is (before the next step); a
rank that dies inside a forward fails the collective (its connection closes) or, if it hangs, the
collective times out after ``--parallel-timeout``; while the engine idles, ``watch`` pings every
actor and gives up on one that has not answered within ``--parallel-timeout``. Either way the
engine stops and is restarted whole (as with local workers).

Every node needs tripod, in the same Python environment, and the model at the same path.
"""

from __future__ import annotations

import logging
import socket
import time
from types import ModuleType
from typing import Any

import torch

from tripod.config import EngineConfig
from tripod.engine.executor.group import (
    RankStep,
    WorkerGroup,
    WorkerLost,
    WorkerSpec,
    destroy_group,
    init_group,
)
from tripod.engine.executor.worker import RankWorker
from tripod.protocol.stats import RankCard

log = logging.getLogger(__name__)

STRATEGIES = {"pack": "PACK", "spread": "SPREAD", "strict-pack": "STRICT_PACK", "strict-spread": "STRICT_SPREAD"}
PLACE_TIMEOUT = 300.0  # seconds the placement group may wait for room on the cluster


def import_ray() -> ModuleType:
    try:
        import ray
    except ImportError as e:
        raise ValueError('--parallel-backend ray needs Ray: pip install "tripod[ray]"') from e
    return ray


class RankActor:
    """The Ray actor behind one rank > 0: a ``RankWorker`` and the node it runs on."""

    def __init__(self) -> None:
        self.worker: RankWorker | None = None

    def start(self, spec: WorkerSpec) -> tuple[str, int]:
        """Join the group (blocks until every rank has), load this rank's shard; the node's id and
        the KV slots this rank's memory allows."""
        import ray

        logging.basicConfig(level=spec.log_level,
                            format=f"%(asctime)s %(levelname)s %(name)s[tp{spec.rank}]: %(message)s")
        self.worker = RankWorker(spec)
        return str(ray.get_runtime_context().get_node_id()), self.worker.budget

    def make_pool(self, num_slots: int) -> RankCard:
        import ray

        assert self.worker is not None
        card = self.worker.make_pool(num_slots)
        card.node = str(ray.get_runtime_context().get_node_id())
        return card

    def run(self, step: RankStep) -> None:
        assert self.worker is not None
        self.worker.run(step)

    def ping(self) -> bool:
        return True

    def stop(self) -> None:
        destroy_group()


class RayWorkers(WorkerGroup):
    """Ranks 1..N-1 as Ray actors in one placement group; this process is rank 0 (a Ray driver)."""

    def __init__(self, config: EngineConfig) -> None:
        ray = import_ray()
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.ray = ray
        self.size = config.world_size
        self.timeout = config.parallel_timeout
        self.ready: list[RankCard] = []
        self.nodes: list[str] = []  # each rank's Ray node id, rank 0 first (set by wait_ready)
        self._owns_ray = False
        if not ray.is_initialized():
            kwargs: dict[str, Any] = dict(address=config.parallel_ray_address, namespace="tripod",
                                          include_dashboard=False, log_to_driver=False)
            if config.parallel_ray_address is None:
                kwargs["num_cpus"] = max(self.size, torch.get_num_threads())
            try:
                ray.init(**kwargs)
            except ConnectionError as e:
                raise ValueError(f"no Ray cluster at {config.parallel_ray_address!r} ({e}): start one with "
                                 "`ray start --head`, or leave --parallel-ray-address out for a Ray instance of "
                                 "this process") from e
            self._owns_ray = config.parallel_ray_address is None
        cuda = config.torch_device().type == "cuda"
        threads = config.num_threads or 1
        bundle: dict[str, float] = {"CPU": float(threads), **({"GPU": 1.0} if cuda else {})}
        self._remove = remove_placement_group
        self.pg = placement_group([dict(bundle) for _ in range(self.size - 1)],
                                  strategy=STRATEGIES[config.parallel_placement], name=f"tripod-{id(self):x}")
        try:
            ray.get(self.pg.ready(), timeout=PLACE_TIMEOUT)
        except ray.exceptions.GetTimeoutError:
            self._remove(self.pg)
            raise ValueError(f"Ray could not place {self.size - 1} worker(s) of {bundle} each "
                             f"({config.parallel_placement}) in {PLACE_TIMEOUT:.0f} s: `ray status` shows what the "
                             "cluster has") from None
        host = ray.util.get_node_ip_address()
        init = f"tcp://{_bracket(host)}:{_free_port(host)}"
        actor_class = ray.remote(RankActor)
        self.actors = [
            actor_class.options(
                num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0), max_restarts=0, max_concurrency=1,
                name=f"tripod-rank{rank}-{id(self):x}",
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=rank - 1),
            ).remote()
            for rank in range(1, self.size)
        ]
        level = logging.getLogger().level
        self._starts = [a.start.remote(WorkerSpec(config, rank, init, threads, level))
                        for rank, a in enumerate(self.actors, start=1)]
        self._pending: list[Any] = []  # results of steps sent and not yet seen
        self._pings: tuple[list[Any], float] | None = None
        try:
            self.tp, self.pp = init_group(config, 0, init)
        except Exception:
            self.close()
            raise
        self.nodes.append(str(ray.get_runtime_context().get_node_id()))
        self.node = self.nodes[0]

    def _get(self, refs: list[Any], what: str) -> list[Any]:
        try:
            return list(self.ray.get(refs, timeout=PLACE_TIMEOUT))
        except self.ray.exceptions.RayError as e:
            raise WorkerLost(f"a Ray rank failed {what}: {e}") from e

    def wait_ready(self, budget: int) -> tuple[int, list[RankCard]]:
        started = self._get(self._starts, "to load its shard")
        self.nodes += [node for node, _ in started]
        num_slots = min([budget, *(b for _, b in started)])
        self.ready = self._get([a.make_pool.remote(num_slots) for a in self.actors], "to make its KV pool")
        log.info("ranks placed on Ray nodes %s", ", ".join(n[:8] for n in self.nodes))
        return num_slots, self.ready

    def _reap(self, refs: list[Any]) -> list[Any]:
        """Raise for any finished call that failed; the ones still running."""
        if not refs:
            return refs
        done, running = self.ray.wait(refs, num_returns=len(refs), timeout=0)
        for ref in done:
            try:
                self.ray.get(ref)
            except self.ray.exceptions.RayError as e:
                raise WorkerLost(f"a Ray rank of the group failed: {e}") from e
        return list(running)

    def check(self) -> None:
        self._pending = self._reap(self._pending)

    def watch(self) -> None:
        self.check()
        if self._pings is None:
            self._pings = ([a.ping.remote() for a in self.actors], time.monotonic())
            return
        refs, since = self._pings
        left = self._reap(refs)
        if not left:
            self._pings = None
        elif time.monotonic() - since > self.timeout:
            raise WorkerLost(f"a Ray rank has not answered for {self.timeout:.0f} s (--parallel-timeout)")

    def deliver(self, steps: list[RankStep]) -> None:
        self._pending += [a.run.remote(step) for a, step in zip(self.actors, steps, strict=True)]

    def close(self) -> None:
        ray = self.ray
        for a in self.actors if hasattr(self, "actors") else []:
            try:
                ray.kill(a, no_restart=True)
            except Exception as e:  # already gone
                log.debug("killing a rank's actor: %s", e)
        destroy_group()
        if hasattr(self, "pg"):
            try:
                self._remove(self.pg)
            except Exception as e:
                log.debug("removing the placement group: %s", e)
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
        self._owns_ray = False


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
