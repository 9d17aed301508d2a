"""One replica of one chainlet: a process (``tripod chains worker``, launched by ``tripod chains
serve``) that imports the chain's file, builds the chainlet with its dependencies as remote
handles and its LLMs as clients of the chain's router, and serves it over HTTP:

- ``POST /run``: one call (see ``tripod.chains.run_endpoint``);
- ``GET /health``: 200 while it takes calls (503 once draining);
- ``GET /metrics``: this process's ``ChainMetrics`` (the calls it served and the calls it made).

Its dependencies' replicas are found through the chain server's ``/chain/replicas``. SIGTERM
drains it: calls in flight finish, new ones go elsewhere. Exit 2 when the chainlet cannot be built.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from tripod import tracing
from tripod.asgi import DrainingServer
from tripod.chains.core import Chainlet, Dependency, LLMSpec, Runtime
from tripod.chains.errors import ChainletError
from tripod.chains.llm_client import ClientPool, Endpoint, LLMClient
from tripod.chains.loader import load_chain
from tripod.chains.metrics import ChainMetrics
from tripod.chains.remote import PollingSource, RemoteHandle, ReplicaSource
from tripod.chains.run_endpoint import run_endpoint
from tripod.chains.runtime import execute, execute_stream, parse_args
from tripod.chains.signature import Signature
from tripod.protocol.chains import ReplicaList, WorkerHealth, decode, encode

log = logging.getLogger("tripod.chains")


class ServedRuntime(Runtime):
    """The chain context of a served replica: dependencies are ``RemoteHandle``s, LLMs are clients
    of the chain server's model router."""

    def __init__(self, server_url: str, metrics: ChainMetrics, source: ReplicaSource, clients: ClientPool,
                 llm_clients: ClientPool | None = None) -> None:
        self.server_url = server_url.rstrip("/")
        self.metrics = metrics
        self.source = source
        self.clients = clients
        self.llm_clients = llm_clients or ClientPool(600.0)

    def dependency(self, dep: Dependency, caller: type[Chainlet]) -> RemoteHandle:
        return RemoteHandle(dep, caller.__name__, self.metrics, self.source, self.clients)

    def llm(self, spec: LLMSpec, caller: type[Chainlet]) -> LLMClient:
        return LLMClient(Endpoint(self.server_url), spec.model, spec.defaults, self.llm_clients)


def server_source(server_url: str, clients: ClientPool, refresh_s: float = 0.5) -> PollingSource:
    """Replica lists from the chain server's ``/chain/replicas``."""

    async def fetch() -> dict[str, list[str]]:
        r = await clients.get().get(server_url.rstrip("/") + "/chain/replicas", timeout=5.0)
        r.raise_for_status()
        return decode(r.content, ReplicaList).replicas

    return PollingSource(fetch, refresh_s)


def build_worker_app(instance: Chainlet, sig: Signature, metrics: ChainMetrics,
                     draining: list[bool] | None = None) -> Starlette:
    flag = draining if draining is not None else [False]

    async def call(args: dict[str, Any]) -> Any:
        return await execute(instance, sig, args, metrics)

    def stream(args: dict[str, Any]) -> Any:
        return execute_stream(instance, sig, args, metrics)

    run = run_endpoint(sig, metrics, call, stream, lambda payload: parse_args(sig, payload, metrics))

    async def run_route(request: Request) -> Response:
        if flag[0]:
            e = ChainletError(sig.name, "this replica is draining; call another", code="unavailable", status=503,
                              retryable=True)
            return Response(e.to_json(), status_code=503, media_type="application/json")
        return await run(request)

    async def health(_: Request) -> Response:
        ok = not flag[0]
        body = WorkerHealth("ok" if ok else "draining", sig.name, os.getpid(), sig.streaming)
        return Response(encode(body), status_code=200 if ok else 503, media_type="application/json")

    async def metrics_page(_: Request) -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    middleware = [Middleware(tracing.TraceMiddleware, component="chains", traced=lambda path: path == "/run")] \
        if tracing.ACTIVE else []
    return Starlette(routes=[Route("/run", run_route, methods=["POST"]),
                             Route("/health", health, methods=["GET"]),
                             Route("/metrics", metrics_page, methods=["GET"])], middleware=middleware)


def main(args: argparse.Namespace) -> int:
    level = getattr(logging, str(args.log_level).upper(), logging.INFO)
    try:
        tracing.configure("tripod-chains", args.otel_endpoint, args.otel_file)
    except tracing.TracingUnavailable as e:
        log.error("%s", e)
        return 2
    try:
        _, graph = load_chain(args.file, args.entrypoint)
        node = graph.nodes[args.chainlet]
    except KeyError:
        log.error("the chain in %s has no chainlet %r", args.file, args.chainlet)
        return 2
    except Exception:
        log.exception("cannot load the chain in %s", args.file)
        return 2
    metrics = ChainMetrics()
    clients = ClientPool(None)
    runtime = ServedRuntime(args.server, metrics, server_source(args.server, clients), clients)
    token = runtime.activate()
    try:
        instance = node.cls()
    except Exception:
        log.exception("%s() failed", node.name)
        return 2
    finally:
        runtime.deactivate(token)
    draining = [False]
    app = build_worker_app(instance, node.cls.__tripod_signature__, metrics, draining)
    logging.getLogger("httpx").setLevel(max(level, logging.WARNING))
    uv = uvicorn.Config(app, host=args.host, port=args.port, log_level=logging.getLevelName(level).lower(),
                        access_log=False, timeout_graceful_shutdown=max(1, int(args.drain_timeout)),
                        lifespan="off", timeout_keep_alive=60)

    def on_signal(sig: signal.Signals) -> None:
        draining[0] = True

    server = DrainingServer(uv, on_signal)
    log.info("chainlet %s serving at http://%s:%d (pid %d)", node.name, args.host, args.port, os.getpid())
    try:
        server.run()
    except SystemExit:
        return 2
    finally:
        tracing.shutdown()
    return 0 if server.started else 2
