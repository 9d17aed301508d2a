"""The router's HTTP face: the same OpenAI and Anthropic routes as a server, plus /fleet (the
replica table).

``/v1/chat/completions``, ``/v1/completions``, ``/v1/messages``, ``/v1/messages/count_tokens``,
``/tokenize``, ``/detokenize`` are proxied to the replica the policy picks; ``/v1/models`` to any
routable replica. ``/health`` is 200 while at least one replica is routable. ``/metrics`` is the
router's own Prometheus page. The router's own errors on ``/v1/messages`` take Anthropic's shape.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tripod.console.app import Console
from tripod.router.console_source import RouterConsoleSource, SupervisorView
from tripod.router.replica import Replica
from tripod.router.router import Router, RouterError, is_anthropic

log = logging.getLogger("tripod.router")

_PROXIED = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens", "/tokenize",
            "/detokenize")


def json_object(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or a 400 saying what is wrong with it."""
    try:
        body = json.loads(raw)
    except ValueError as e:
        raise RouterError(400, f"the request body is not valid JSON ({e}); send a JSON object",
                          "invalid_json") from None
    if not isinstance(body, dict):
        raise RouterError(400, "the request body must be a JSON object", "invalid_json")
    return body


async def _read_body(request: Request, limit: int) -> bytes:
    length = request.headers.get("content-length")
    too_big = RouterError(413, f"the request body is larger than {limit} bytes; send a smaller one",
                          "request_too_large")
    if length is not None and length.isdigit() and int(length) > limit:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (the body is already read: only a disconnect can come)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def build_router_app(router: Router, lifespan: Any = None,
                     fleet_info: Callable[[], dict[str, Any]] | None = None,
                     supervisor: SupervisorView | None = None) -> Starlette:
    """The router's app; ``supervisor`` (a fleet this process launched) adds the slots that are
    down and the autoscaler to the console's fleet view."""
    metrics = router.metrics
    console = Console(RouterConsoleSource(router, supervisor), api_key=router.config.api_key,
                      bench_dir=router.config.bench_dir)

    def counted(route: str, fn: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        async def handler(request: Request) -> Response:
            try:
                resp = await fn(request)
            except RouterError as e:
                resp = e.response(anthropic=is_anthropic(request.url.path))
            metrics.http_requests.labels(route, str(resp.status_code)).inc()
            return resp
        return handler

    async def proxied(request: Request) -> Response:
        raw = await _read_body(request, router.config.max_body_bytes)
        body = json_object(raw)
        forward = asyncio.ensure_future(router.forward(request.url.path, raw, body, dict(request.headers)))
        gone = asyncio.ensure_future(_disconnected(request))
        await asyncio.wait({forward, gone}, return_when=asyncio.FIRST_COMPLETED)
        if forward.done():
            gone.cancel()
            return forward.result()
        # NOTE: the client left while the router waited on a replica (a non-streamed answer, or a
        # stream before its first token): cancelling closes the upstream connection, and the
        # replica aborts the request and frees its KV.
        forward.cancel()
        await asyncio.gather(forward, return_exceptions=True)
        return Response(status_code=499)

    async def models(request: Request) -> Response:
        """Any routable replica's answer (they serve one model)."""
        assert router.probe_client is not None
        tried: set[Replica] = set()
        last = "no replica answered"
        for _ in range(router.config.max_retries + 1):
            rep = (await router.pick(router.route_request("", {}), tried)).replica
            tried.add(rep)
            headers = {k: v for k, v in request.headers.items() if k.lower() in ("authorization", "x-api-key")}
            try:
                r = await router.probe_client.get(rep.url + request.url.path, headers=headers)
            except httpx.HTTPError as e:
                last = f"{rep.name}: {type(e).__name__}"
                continue
            if r.status_code < 500:
                return Response(r.content, status_code=r.status_code, media_type="application/json",
                                headers={"x-tripod-replica": rep.name})
            last = f"{rep.name} answered {r.status_code}"
        raise RouterError(503, f"could not list models: {last}; retry shortly", "no_replica",
                          router.config.retry_after)

    async def health(_: Request) -> Response:
        n = len(router.routable())
        ok = n > 0 and not router.draining
        status = "draining" if router.draining else ("ok" if ok else "no routable replica")
        return JSONResponse({"status": status, "routable_replicas": n, "replicas": len(router.replicas)},
                            status_code=200 if ok else 503)

    async def metrics_page(_: Request) -> Response:
        page = metrics.render(router.replicas.values(), router.queue_depth, router.pending)
        return Response(page, media_type="text/plain; version=0.0.4")

    async def fleet(_: Request) -> Response:
        body: dict[str, Any] = {
            "policy": router.policy.name, "pending": router.pending, "queue_depth": router.queue_depth,
            "chars_per_token": round(router.chars_per_token, 3),
            "replicas": [r.describe() for r in router.replicas.values()],
        }
        if fleet_info is not None:
            body.update(fleet_info())
        return JSONResponse(body)

    routes = [Route(p, counted(p, proxied), methods=["POST"]) for p in _PROXIED]
    routes += [
        Route("/v1/models", counted("/v1/models", models), methods=["GET"]),
        Route("/v1/models/{model_id:path}", counted("/v1/models", models), methods=["GET"]),
        Route("/health", counted("/health", health), methods=["GET"]),
        Route("/metrics", metrics_page, methods=["GET"]),
        Route("/fleet", fleet, methods=["GET"]),
        *console.routes(),  # /ui: the console (tripod.console)
    ]

    async def not_found(request: Request, e: Exception) -> Response:
        code = e.status_code if isinstance(e, HTTPException) else 500
        msg = {404: "no such route; see /v1/models, /v1/chat/completions, /v1/completions, /v1/messages, /fleet, /ui",
               405: "this method is not allowed on this route"}.get(code, "internal error")
        return RouterError(code, msg, "not_found" if code == 404 else "bad_method").response(
            anthropic=is_anthropic(request.url.path))

    return Starlette(routes=routes, lifespan=console.wrap_lifespan(lifespan), exception_handlers={HTTPException: not_found})
