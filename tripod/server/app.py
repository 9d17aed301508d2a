"""The HTTP shell: the app that puts the API surfaces together, with auth, limits, errors and the
lifespan that starts and stops the engine process.

The surfaces are ``tripod.server.api``'s, one module each: ``openai`` (chat/completions),
``anthropic`` (messages), ``responses`` (the Responses API and its store), ``embeddings``
(embeddings, rerank, score), ``admin`` (models, health, metrics, tokenize; ``lora`` within), ``pd``
(the prefill/decode hand-over, with its ASGI gate); ``openapi`` describes them. What they read is
``state.ServerState``; engine outputs become answers in ``tripod.server.answer``. Every error a
caller can cause is answered with a 4xx in the shape of the API it called (``errors``: OpenAI's
body; Anthropic's on ``/v1/messages``); the engine is only reached by requests that passed every
check.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tripod import tracing
from tripod.asgi import ClientGone
from tripod.console.app import Console, is_open_path
from tripod.server.api.admin import add_admin_routes
from tripod.server.api.anthropic import add_anthropic_routes
from tripod.server.api.embeddings import add_embedding_routes
from tripod.server.api.openai import add_openai_routes
from tripod.server.api.openapi import openapi_document
from tripod.server.api.pd import HandOverGate, Receiving, add_pd_routes
from tripod.server.api.responses import add_responses_routes
from tripod.server.api.rl import RL_ROUTES, add_rl_routes
from tripod.server.console_source import ServerConsoleSource
from tripod.server.errors import APIError, error_response, too_large
from tripod.server.state import ServerState
from tripod.server.traces import finish_request
from tripod.tenants import OverLimit
from tripod.tenants.asgi import TenantMiddleware

__all__ = ["build_app", "lifespan_for"]

log = logging.getLogger("tripod.server")

_OPEN_PATHS = ("/health", "/metrics", "/openapi.json")
_ROUTES = {
    "/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens", "/v1/models",
    "/health", "/metrics", "/tokenize", "/detokenize", "/debug/engine", "/openapi.json", "/v1/responses",
    "/v1/embeddings", "/v1/rerank", "/v1/score", *RL_ROUTES,
}


def route_of(path: str) -> str:
    return path if path in _ROUTES else "other"


def guarded_path(path: str) -> bool:
    """Paths that need a key (when keys are set): all but /health, /metrics, /openapi.json and the
    console's page shell (NOTE: it holds no data; its JSON API, /ui/api/*, is guarded)."""
    return path not in _OPEN_PATHS and not is_open_path(path)


_GENERATING = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses",  # (admitted into
                         "/v1/embeddings", "/v1/rerank", "/rerank", "/v2/rerank", "/v1/score"})  # the limits)


def _over_limit(path: str, e: OverLimit) -> ASGIApp:
    return error_response(APIError(429, str(e), type="rate_limit_error", code="rate_limit_exceeded",
                                   headers={"Retry-After": e.retry_after_header}), path)


def _unauthorized(path: str, message: str) -> ASGIApp:
    return error_response(APIError(401, message, type="invalid_request_error", code="invalid_api_key"), path)


def tenant_route(path: str) -> bool:
    """The routes whose requests are attributed, counted per tenant and audited (the API's)."""
    # NOTE: not the prefill/decode hand-over (/v1/pd/*): the request it serves is counted where it is answered.
    return (path.startswith("/v1/") and not path.startswith("/v1/pd/")) or path in ("/tokenize", "/detokenize")


class BodyLimit:
    """Pure ASGI: a request whose Content-Length is past ``limit`` gets 413 before it is read."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        length = dict(scope["headers"]).get(b"content-length") if scope["type"] == "http" else None
        if length is not None:
            try:
                big = int(length) > self.limit
            except ValueError:
                big = False
            if big:
                await error_response(too_large(self.limit), scope["path"])(scope, receive, send)
                return
        await self.app(scope, receive, send)


class GuardMiddleware:
    """Pure ASGI (so streaming and disconnects pass through untouched): the per-route status
    counter, around who is calling (``tripod.tenants.asgi.TenantMiddleware``: the key, a 401, the
    tenant's bookkeeping), around the body size limit."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        inner = BodyLimit(app, state.config.max_body_bytes)
        self.app = TenantMiddleware(inner, state.tenants, _unauthorized, guarded_path, tenant_route, route_of,
                                    limited=_GENERATING.__contains__, over_limit=_over_limit)
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status_box = [500]

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status_box[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            self.state.metrics.http_requests.labels(route_of(scope["path"]), str(status_box[0])).inc()


def build_app(state: ServerState, lifespan: Any = None) -> FastAPI:
    console = Console(ServerConsoleSource(state), api_key=state.config.api_key, bench_dir=state.config.bench_dir)
    app = FastAPI(title="tripod", lifespan=console.wrap_lifespan(lifespan), docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json")
    app.state.tripod = state
    app.add_middleware(HandOverGate, receiving=Receiving())  # inside the key check (server/api/pd.py)
    app.add_middleware(GuardMiddleware, state=state)
    if tracing.ACTIVE:  # outermost: the span covers the whole request (and the tenant's 401/429)
        app.add_middleware(tracing.TraceMiddleware, component="server", traced=tenant_route, finish=finish_request)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return error_response(e, request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        msg = {404: "no such route; see /v1/models, /v1/chat/completions, /v1/completions, /v1/responses, /v1/messages, /ui",
               405: "this method is not allowed on this route"}.get(e.status_code, str(e.detail))
        return error_response(APIError(e.status_code, msg), request.url.path)

    @app.exception_handler(ClientGone)
    async def _gone(_: Request, e: ClientGone) -> Response:
        return Response(status_code=499)

    add_admin_routes(app, state)
    add_openai_routes(app, state)
    add_anthropic_routes(app, state)
    add_responses_routes(app, state)
    add_embedding_routes(app, state)
    add_pd_routes(app, state)
    if state.config.enable_rl_api:  # (without the flag the routes do not exist: 404)
        add_rl_routes(app, state)
    app.router.routes.extend(console.routes())  # /ui: the console (tripod.console)
    document: dict[str, Any] = {}

    def openapi() -> dict[str, Any]:
        if not document:
            document.update(openapi_document(app))
        return document

    app.openapi = openapi  # type: ignore[method-assign]
    return app


@contextlib.asynccontextmanager
async def lifespan_for(state: ServerState) -> AsyncIterator[None]:
    """Start the engine process before the port opens; stop it after the last answer."""
    info = await state.client.start()
    state.engine_ready()
    log.info(
        "engine ready: %s (%s, stored as %s, weights %s, dtype %s), context %d, pid %d, compute %s",
        state.model_name, info.architecture, state.quantization, state.engine_config.weights, info.dtype,
        info.max_request_len, info.pid, info.compute.as_json(),
    )
    ec = state.engine_config
    if ec.speculative:
        log.info("speculative decoding: %s, up to %d draft tokens per request, while at most %d requests decode",
                 ec.speculative, ec.num_draft_tokens, ec.spec_max_batch)
    cfg = state.config
    tools = state.chat.describe()
    scheme = "https" if cfg.ssl_certfile else "http"
    log.info("serving the OpenAI API at %s://%s:%d/v1 and the Anthropic Messages API at /v1/messages%s; "
             "tool calls: %s syntax, %s prompt format", scheme, cfg.host, cfg.port,
             " (API key required)" if not state.tenants.registry.open else "", tools["parser"], tools["prompt_format"])
    if cfg.tenants:
        log.info("tenants: %d from %s (limits enforced: %s; reloaded on SIGHUP and when the file changes)",
                 len(state.tenants.registry.tenants()), cfg.tenants, cfg.tenant_limits)
    try:
        async with state.tenants.registry.watching():
            yield
    finally:
        await state.client.stop()
        state.tenants.close()
        if state.vision is not None:
            await state.vision.loader.close()
