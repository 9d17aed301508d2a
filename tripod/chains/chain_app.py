"""The chain server's HTTP app: its routes, what they answer, its drain, and the process that runs
it (``serve_chain``, behind ``tripod chains serve``).

``tripod.chains.chain_server`` builds the ``ChainServer`` (the graph, each chainlet's fleet, the
models' router); this module answers for it: ``POST /run`` (the entrypoint, through its
``RemoteHandle``), ``GET /health``, ``GET /metrics`` (every replica's page merged), ``GET /chain``,
``GET /chain/replicas`` and the multi-model router's routes; ``RunCounter`` counts the ``/run``
calls in flight and ``ChainDrain`` waits for them on SIGTERM before the port closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from tripod import tracing
from tripod.asgi import DrainingServer
from tripod.chains.chain_server import CLIENT, ChainServeConfig, ChainServer
from tripod.chains.core import entrypoint_options
from tripod.chains.errors import ChainletError
from tripod.chains.loader import declared_models, load_chain
from tripod.chains.run_endpoint import run_endpoint
from tripod.fleet.multi import multi_router_routes
from tripod.protocol.chains import (
    ChainHealth,
    ChainInfo,
    ChainletInfo,
    ChainletReplicas,
    DependencyInfo,
    EntrypointInfo,
    LLMInfo,
    ModelInfo,
    ReplicaList,
    encode,
)
from tripod.router.merge import merge_pages

log = logging.getLogger("tripod.chains")


def describe(server: ChainServer) -> ChainInfo:
    """``GET /chain``: the graph, each chainlet's contract, replicas, dependencies and LLMs, the models."""
    chainlets = {}
    for name, f in server.fleets.items():
        node = f.node
        replicas = ChainletReplicas(node.replicas, len(f.router.routable()),
                                    [r.info() for r in f.router.replicas.values()],
                                    f.supervisor.info()["restarts"])
        chainlets[name] = ChainletInfo(
            **node.cls.__tripod_signature__.describe(), replicas=replicas,
            dependencies={param: DependencyInfo(d.cls.__name__, d.retries, d.timeout_s, d.replicas)
                          for param, d in node.deps.items()},
            llms={attr: LLMInfo(s.model, s.defaults) for attr, s in node.llms.items()})
    opts = entrypoint_options(server.graph.entrypoint)
    return ChainInfo(entrypoint=server.graph.entrypoint.__name__, file=str(Path(server.cfg.file).resolve()),
                     backend=server.cfg.backend, streaming=server.sig.streaming,
                     entrypoint_options=EntrypointInfo(opts.retries, opts.timeout_s), chainlets=chainlets,
                     models={n: ModelInfo(m.source, len(m.router.routable()),
                                          [r.info() for r in m.router.replicas.values()])
                             for n, m in server.models.fleets.items()})


async def metrics_page(server: ChainServer) -> bytes:
    """``GET /metrics``: this process's chain metrics and every routable replica's, labelled
    ``replica``, then the models' router metrics."""
    targets = [(f"{name}/{rep.name}", rep.url) for name, f in server.fleets.items()
               for rep in f.router.replicas.values() if rep.routable]

    async def scrape(url: str) -> str:
        try:
            r = await server.scraper.get(url + "/metrics")
            return r.text if r.status_code == 200 else ""
        except httpx.HTTPError:
            return ""

    texts = await asyncio.gather(*(scrape(u) for _, u in targets))
    pages = [({"replica": "server"}, server.metrics.render().decode())]
    pages += [({"replica": label}, text) for (label, _), text in zip(targets, texts, strict=True) if text]
    page = merge_pages(pages)
    if server.models.fleets:
        page += server.models.metrics_page()
    return page


def _json(msg: Any, status: int = 200) -> Response:
    return Response(encode(msg), status_code=status, media_type="application/json")


def chain_routes(server: ChainServer) -> list[Route]:
    """Every route of the chain server (the chain's own, then the models' router's)."""
    sig = server.sig

    def parse(payload: Any) -> dict[str, Any]:
        if server.draining:
            raise ChainletError(sig.name, "the chain is shutting down; retry shortly", code="draining",
                                status=503, retryable=True)
        try:
            return sig.parse_args(payload)
        except ChainletError as e:
            server.metrics.failures.labels(CLIENT, sig.name, e.code).inc()
            raise

    async def call(args: dict[str, Any]) -> Any:
        return sig.dump_output(await server.entry.run(**args))

    async def stream(args: dict[str, Any]) -> AsyncIterator[Any]:
        async for item in server.entry.run(**args):
            yield sig.dump_output(item)

    run = run_endpoint(sig, server.metrics, call, stream, parse)

    async def health(_: Request) -> Response:
        # NOTE: ok with one routable replica each: the chain answers /run then, and a replica that
        # died and restarts must not take the whole chain out of rotation. Start-up, before the
        # port opens, waits for every chainlet replica (ChainServer.wait_ready); the counts below
        # say the capacity at any time.
        ok = server.ready() and not server.draining
        status = "draining" if server.draining else ("ok" if ok else "starting")
        return _json(ChainHealth(status, sig.name, {n: len(f.router.routable()) for n, f in server.fleets.items()},
                                 {n: len(m.router.routable()) for n, m in server.models.fleets.items()}),
                     200 if ok else 503)

    async def metrics(_: Request) -> Response:
        return Response(await metrics_page(server), media_type="text/plain; version=0.0.4")

    async def chain(_: Request) -> Response:
        return _json(describe(server))

    async def replicas(_: Request) -> Response:
        return _json(ReplicaList({n: [r.url for r in f.router.routable()] for n, f in server.fleets.items()}))

    return [Route("/run", run, methods=["POST"]), Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]), Route("/chain", chain, methods=["GET"]),
            Route("/chain/replicas", replicas, methods=["GET"]), *multi_router_routes(server.models)]


class RunCounter:
    """Counts the ``/run`` calls in flight (a streamed one until its last byte)."""

    def __init__(self, app: Any, server: ChainServer) -> None:
        self.app = app
        self.server = server

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("path") != "/run":
            await self.app(scope, receive, send)
            return
        self.server.running += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.server.running -= 1


class ChainDrain(DrainingServer):
    """Drains before the port closes: the chainlets of calls in flight still reach the models
    through this port. The first SIGTERM/SIGINT refuses new ``/run`` calls (503) and waits (up to
    the drain timeout) for those in flight; then uvicorn stops as usual. A second one stops now."""

    def __init__(self, config: uvicorn.Config, server: ChainServer) -> None:
        super().__init__(config, self._on_signal)
        self.server = server
        self._draining_task: asyncio.Task[None] | None = None

    def _on_signal(self, sig: signal.Signals) -> None:
        pass

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self._draining_task is not None or not self.started:
            super().handle_exit(sig, frame)
            return
        log.info("%s: draining %d call(s) in flight, then stopping every replica", signal.Signals(sig).name,
                 self.server.running)
        self.server.draining = True
        loop = asyncio.get_event_loop()
        self._draining_task = loop.create_task(self._drain(sig, frame))
        loop.call_soon_threadsafe(lambda: None)  # NOTE: wakes the loop (we are in a signal handler)

    async def _drain(self, sig: int, frame: Any) -> None:
        deadline = asyncio.get_running_loop().time() + self.server.cfg.drain_timeout
        while self.server.running and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)  # NOTE: a bounded wait for calls the app does not signal the end of
        super().handle_exit(sig, frame)


def serve_chain(cfg: ChainServeConfig) -> int:
    """Run the chain server until SIGTERM/SIGINT. 0 after a clean stop; 2 when start-up failed."""
    level = getattr(logging, str(cfg.log_level).upper(), logging.INFO)
    try:
        tracing.configure("tripod-chains", cfg.otel_endpoint, cfg.otel_file)
        module, graph = load_chain(cfg.file, cfg.entrypoint)
        server = ChainServer(cfg, graph, declared_models(module))
    except (ValueError, FileNotFoundError, tracing.TracingUnavailable) as e:
        print(f"tripod: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        log.exception("cannot load the chain in %s", cfg.file)
        print(f"tripod: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2

    @contextlib.asynccontextmanager
    async def lifespan(_app: Any) -> AsyncIterator[None]:
        await server.start()
        try:
            why = await server.wait_ready(cfg.start_timeout)
            if why is not None:
                server.failed = why
                raise RuntimeError(why + (f" (replica logs in {cfg.log_dir})" if cfg.log_dir else ""))
            log.info("chain %s ready at %s/run: %s; models: %s (pid %d)", graph.entrypoint.__name__, server.url,
                     ", ".join(f"{n}×{f.node.replicas}" for n, f in server.fleets.items()),
                     ", ".join(server.models.fleets) or "none", os.getpid())
            yield
        finally:
            await server.stop()

    app: Any = RunCounter(Starlette(routes=chain_routes(server), lifespan=lifespan), server)
    if tracing.ACTIVE:  # /run and the models' routes (the router's attempts are spans too)
        app = tracing.TraceMiddleware(app, "chains", lambda path: path == "/run" or path.startswith("/v1/"))
    logging.getLogger("httpx").setLevel(max(level, logging.WARNING))
    uv = uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level=logging.getLevelName(level).lower(),
                        access_log=False, timeout_graceful_shutdown=max(1, int(cfg.drain_timeout)), lifespan="on",
                        timeout_keep_alive=60)
    srv = ChainDrain(uv, server)
    try:
        srv.run()
    except SystemExit:
        return 2
    finally:
        tracing.shutdown()
    return 2 if server.failed or not srv.started else 0
