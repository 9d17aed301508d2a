"""``tripod chains serve FILE.py``: a chain as one service.

One process, the chain server, listens on ``--host``/``--port`` and owns everything else:

- each chainlet's replicas: processes (``tripod chains worker``) or Ray actors, launched,
  health-probed, restarted and drained by the fleet's ``Supervisor`` and ``Router``, one pair per
  chainlet, with the replica count its callers ask for;
- each model's fleet: ``tripod serve`` replicas behind their own ``Router``/``Supervisor``
  (autoscaled when the model's declaration gives ``min_replicas``/``max_replicas``), or a URL that
  serves it already, all behind one multi-model router (``tripod.fleet.multi``) mounted on the
  same port: ``/v1/chat/completions`` etc. route by the request's ``model``, ``/v1/models`` lists
  them, ``/fleet`` describes every model's fleet;
- the chain's own routes: ``POST /run`` (the entrypoint, called with its ``retries``/``timeout_s``;
  SSE when it streams), ``GET /health`` (200 while every chainlet and model has a routable
  replica: a replica restarting leaves the chain in rotation), ``GET /metrics`` (every replica's
  chainlet metrics, labelled ``replica``, plus the models' router metrics, labelled ``model``),
  ``GET /chain`` (the graph, each chainlet's replicas), ``GET /chain/replicas`` (routable replica
  URLs, what the chainlets poll to call each other).

The port opens once start-up is done: every chainlet with all its replicas routable, every model
with one (``ChainServer.wait_ready``), so the first ``/health`` already counts what was declared.

Chainlets call each other directly, replica to replica (no hop through this process); they reach
the models through this process's router. SIGTERM drains: ``/run`` answers 503, calls in flight
finish, then every replica drains and exits. Exit 2 when start-up fails.

This module holds the server's state: the graph, and the fleets it launches for the chainlets and
the models (``ChainServer``); ``tripod.chains.chain_app`` is its HTTP app (routes, drain) and runs
it (``serve_chain``).
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tripod.chains.core import Dependency, Graph, Model, Node, entrypoint_options
from tripod.chains.llm_client import ClientPool
from tripod.chains.metrics import ChainMetrics
from tripod.chains.remote import RemoteHandle, ReplicaSource
from tripod.config import FleetConfig, RouterConfig
from tripod.fleet.multi import MultiRouter
from tripod.fleet.replicas import LocalLauncher, ReplicaLauncher
from tripod.fleet.supervisor import Supervisor
from tripod.router.router import Router

WORKER = ("chains", "worker")
CLIENT = "client"  # the caller name of calls made by the chain server (to the entrypoint)


@dataclass
class ChainServeConfig:
    """Everything ``tripod chains serve`` takes."""

    file: str
    entrypoint: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    backend: str = "local"  # local | ray
    ray_address: str | None = None
    ray_num_cpus: float = 1.0  # each model replica's actor (chainlet actors reserve none)
    ray_num_gpus: float = 0.0
    models: dict[str, str] = field(default_factory=dict)  # name → PATH ('' = embedded) or URL
    model_args: list[str] = field(default_factory=list)  # tripod serve options for every model's replicas
    model_args_by: dict[str, list[str]] = field(default_factory=dict)  # … for one model's
    router_policy: str = "cache_aware"
    start_timeout: float = 300.0
    drain_timeout: float = 30.0
    health_interval: float = 0.5  # chainlet replicas' health probes
    log_dir: Path | None = None
    log_level: str = "INFO"
    otel_endpoint: str | None = None  # tracing (tripod.tracing): the chain server, its chainlets and its models
    otel_file: str | None = None

    def otel_args(self) -> list[str]:
        """The tracing options every process of the chain is started with."""
        return [*(["--otel-endpoint", self.otel_endpoint] if self.otel_endpoint else []),
                *(["--otel-file", self.otel_file] if self.otel_file else [])]

    def __post_init__(self) -> None:
        if self.backend not in ("local", "ray"):
            raise ValueError(f"backend must be 'local' or 'ray' (got {self.backend!r})")
        if not 1 <= self.port <= 65535:
            raise ValueError(f"port must be in [1, 65535] (got {self.port})")


@dataclass
class ChainletFleet:
    node: Node
    router: Router
    supervisor: Supervisor

    @property
    def name(self) -> str:
        return self.node.name


class RouterSource(ReplicaSource):
    """Replica URLs straight from the chainlets' routers (in the chain server)."""

    def __init__(self, fleets: dict[str, ChainletFleet]) -> None:
        self.fleets = fleets

    def urls(self, chainlet: str) -> list[str]:
        f = self.fleets.get(chainlet)
        return [r.url for r in f.router.routable()] if f else []

    async def wait(self, chainlet: str, timeout: float, avoid: frozenset[str] = frozenset()) -> list[str]:
        f = self.fleets.get(chainlet)
        if f is not None:
            await f.router.wait_until(lambda: bool({r.url for r in f.router.routable()} - avoid), timeout)
        return self.urls(chainlet)

    def failed(self, chainlet: str, url: str) -> None:
        f = self.fleets.get(chainlet)
        if f is None:
            return
        for rep in list(f.router.replicas.values()):
            if rep.url == url:
                f.router.record_failure(rep, "a call to it lost its connection", fatal=True)


def _advertised_host(host: str) -> str:
    return "127.0.0.1" if host in ("", "0.0.0.0", "::", "localhost") else host


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _has_option(args: list[str], opt: str) -> bool:
    return any(a == opt or a.startswith(opt + "=") for a in args)


class ChainServer:
    """The chain server's state: the graph, the chainlets' fleets, the models' router."""

    def __init__(self, cfg: ChainServeConfig, graph: Graph, declared: dict[str, Model]) -> None:
        self.cfg = cfg
        self.graph = graph
        self.metrics = ChainMetrics()
        self.draining = False
        self.running = 0  # /run calls in flight
        self.failed: str | None = None
        self.url = _url(_advertised_host(cfg.host), cfg.port)
        self.log_dir = cfg.log_dir
        self.fleets: dict[str, ChainletFleet] = {}
        self.models = MultiRouter()
        self.clients = ClientPool(None)
        self.scraper = httpx.AsyncClient(timeout=2.0)  # the replicas' /metrics
        self._own_ray = False
        if cfg.backend == "ray":
            self._init_ray()
        for node in graph.nodes.values():
            self.fleets[node.name] = self._chainlet_fleet(node)
        self._add_models(graph, declared)
        ep = graph.entrypoint
        opts = entrypoint_options(ep)
        self.entry = RemoteHandle(Dependency(ep, opts.retries, opts.timeout_s, opts.replicas), CLIENT,
                                  self.metrics, RouterSource(self.fleets), self.clients)
        self.sig = ep.__tripod_signature__

    # ------------------------------------------------------------ building
    def _init_ray(self) -> None:
        from tripod.fleet.ray_backend import import_ray

        ray = import_ray()
        if ray.is_initialized():
            return
        kwargs: dict[str, Any] = dict(address=self.cfg.ray_address, namespace="tripod", ignore_reinit_error=True,
                                      include_dashboard=False, log_to_driver=False)
        if self.cfg.ray_address is None:
            kwargs["num_cpus"] = os.cpu_count()
        try:
            ray.init(**kwargs)
        except ConnectionError as e:
            raise ValueError(f"no Ray cluster at {self.cfg.ray_address!r} ({e}); start one with "
                             "`ray start --head`, or leave --ray-address out for a local Ray instance") from e
        self._own_ray = True
        if _advertised_host(self.cfg.host) != self.cfg.host:
            # Replicas on other nodes reach this process at its node's address.
            self.url = _url(ray.util.get_node_ip_address(), self.cfg.port) if self.cfg.host in ("0.0.0.0", "::") \
                else self.url

    def _launcher(self, args: list[str], what: str, command: tuple[str, ...], num_cpus: float,
                  num_gpus: float) -> ReplicaLauncher:
        log_dir = self.log_dir / what if self.log_dir is not None else None
        if self.cfg.backend == "ray":
            from tripod.fleet.ray_backend import RayLauncher

            # A local Ray instance behind a loopback chain server: replicas listen on loopback too.
            # On a cluster they listen on their node's address, which the other nodes can reach.
            loopback = self.cfg.ray_address is None and self.cfg.host in ("127.0.0.1", "localhost")
            return RayLauncher(args, address=self.cfg.ray_address, num_cpus=num_cpus, num_gpus=num_gpus,
                               log_dir=str(log_dir) if log_dir else None, command=command,
                               bind_host="127.0.0.1" if loopback else None)
        return LocalLauncher(args, log_dir=log_dir, command=command)

    def _chainlet_fleet(self, node: Node) -> ChainletFleet:
        cfg = self.cfg
        args = ["--file", str(Path(cfg.file).resolve()), "--chainlet", node.name, "--entrypoint",
                self.graph.entrypoint.__name__, "--server", self.url, "--log-level", cfg.log_level,
                "--drain-timeout", str(cfg.drain_timeout), *cfg.otel_args()]
        fleet = FleetConfig(min_replicas=node.replicas, max_replicas=node.replicas, backend=cfg.backend,
                            ray_address=cfg.ray_address, ray_num_cpus=0.0, start_timeout=min(cfg.start_timeout, 120.0),
                            restart_backoff=0.5, restart_backoff_max=10.0, drain_timeout=cfg.drain_timeout)
        router = Router(RouterConfig(policy="least_load", health_interval=cfg.health_interval, health_timeout=2.0,
                                     open_cooldown=0.5, max_retries=0, queue_timeout=30.0))
        launcher = self._launcher(args, f"chainlet-{node.name}", WORKER, 0.0, 0.0)
        return ChainletFleet(node, router, Supervisor(router, launcher, fleet))

    def _add_models(self, graph: Graph, declared: dict[str, Model]) -> None:
        cfg = self.cfg
        used = graph.models()
        names = list(dict.fromkeys([*used, *cfg.models]))
        specs: dict[str, Model] = {}
        for name in names:
            specs[name] = declared.get(name) or used.get(name) or Model(name)
        def url_of(name: str, spec: Model) -> str | None:
            where = cfg.models.get(name)  # the command line wins: a URL, or a path ('' = embedded)
            if where is not None:
                return where if where.startswith(("http://", "https://")) else None
            return spec.url

        total = sum(s.max_replicas or s.replicas for n, s in specs.items() if not url_of(n, s)) or 1
        for name, spec in specs.items():
            where = cfg.models.get(name)
            url = url_of(name, spec)
            router = Router(RouterConfig(policy=cfg.router_policy))
            if url:
                base = url.rstrip("/")
                base = base[: -len("/v1")] if base.endswith("/v1") else base
                router.add_replica("endpoint", base)
                self.models.add(name, router, None, "url")
                continue
            path = where if where is not None else spec.path
            args = [*cfg.model_args, *cfg.model_args_by.get(name, []), *spec.args]
            if path:
                args += ["--model", path]
            args += ["--served-model-name", name, "--log-level", cfg.log_level]
            if not _has_option(args, "--otel-endpoint") and not _has_option(args, "--otel-file"):
                args += cfg.otel_args()
            if not _has_option(args, "--threads") and cfg.backend == "local" and not _has_option(args, "--device"):
                args += ["--threads", str(max(1, (os.cpu_count() or 1) // total))]
            lo = spec.min_replicas or spec.replicas
            hi = max(spec.max_replicas or lo, lo)
            fleet = FleetConfig(min_replicas=lo, max_replicas=hi, backend=cfg.backend, ray_address=cfg.ray_address,
                                ray_num_cpus=cfg.ray_num_cpus, ray_num_gpus=cfg.ray_num_gpus,
                                start_timeout=cfg.start_timeout, drain_timeout=cfg.drain_timeout)
            launcher = self._launcher(args, f"model-{name}", ("serve",), cfg.ray_num_cpus, cfg.ray_num_gpus)
            self.models.add(name, router, Supervisor(router, launcher, fleet), "fleet")

    # ------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        await self.models.start()
        for f in self.fleets.values():
            await f.router.start()
        await asyncio.gather(*(f.supervisor.start() for f in self.fleets.values()))

    async def wait_ready(self, timeout: float) -> str | None:
        """Start-up: None once every chainlet has all its replicas routable and every model one
        (its fleet's rule); else why not, past ``timeout``. The port opens only after this."""
        async def chainlet(f: ChainletFleet) -> str | None:
            # NOTE: every replica, not one: the chain is announced ready (and /health first answers)
            # with the parallelism its callers declared. A chainlet replica is a light process
            # started with the others, so this costs no noticeable time; a model's fleet (minutes
            # per replica, autoscaled) is ready at its first, as `tripod serve --replicas` is.
            want = f.node.replicas
            if await f.supervisor.wait_routable(timeout, want):
                return None
            have = len(f.router.serving())
            return f"chainlet {f.name!r}: " + (f.supervisor.fatal or (
                f"no replica became healthy in {timeout:.0f} s" if not have
                else f"{have} of its {want} replicas became healthy in {timeout:.0f} s"))

        whys = await asyncio.gather(self.models.wait_routable(timeout), *(chainlet(f) for f in self.fleets.values()))
        bad = [w for w in whys if w]
        return "; ".join(bad) or None

    async def stop(self) -> None:
        await asyncio.gather(*(f.supervisor.stop() for f in self.fleets.values()), return_exceptions=True)
        for f in self.fleets.values():
            await f.router.stop()
        await self.models.stop()
        await self.clients.aclose()
        await self.scraper.aclose()
        if self._own_ray:
            import ray

            ray.shutdown()

    def ready(self) -> bool:
        return all(f.router.routable() for f in self.fleets.values()) and self.models.ready()
