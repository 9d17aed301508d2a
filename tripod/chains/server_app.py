"""The chain server's HTTP side: its routes, what they answer, and its drain.

``tripod.chains.serve`` builds the ``ChainServer`` (the graph, each chainlet's fleet, the models'
router); this module answers for it: ``POST /run`` (the entrypoint, through its ``RemoteHandle``),
``GET /health``, ``GET /metrics`` (every replica's page merged), ``GET /chain``, ``GET
/chain/replicas`` and the multi-model router's routes; ``RunCounter`` counts the ``/run`` calls in
flight and ``ChainDrain`` waits for them on SIGTERM before the port closes.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import uvicorn
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from tripod.asgi import DrainingServer
from tripod.chains.core import entrypoint_options
from tripod.chains.errors import ChainletError
from tripod.chains.serving import run_endpoint
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

if TYPE_CHECKING:
    from tripod.chains.serve import ChainServer

log = logging.getLogger("tripod.chains")

CLIENT = "client"  # the caller name of calls made by the chain server (to the entrypoint)


def describe(server: ChainServer) -> ChainInfo:
    """``GET /chain``: the graph, each chainlet's contract, replicas, dependencies and LLMs, the models."""
    chainlets = {}
    for name, f in server.fleets.items():
        node = f.node
        replicas = ChainletReplicas(node.replicas, len(f.router.routable()),
                                    [r.describe() for r in f.router.replicas.values()],
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
                                          [r.describe() for r in m.router.replicas.values()])
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
