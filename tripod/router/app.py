"""The router's HTTP face: the same OpenAI and Anthropic routes as a server, plus /fleet (the
replica table).

``/v1/chat/completions``, ``/v1/completions``, ``/v1/messages``, ``/v1/messages/count_tokens``,
``/tokenize``, ``/detokenize`` are proxied to the replica the policy picks; ``/v1/models`` to any
routable replica. ``/health`` is 200 while at least one replica is routable. ``/metrics`` is the
router's own Prometheus page. The router's own errors on ``/v1/messages`` take Anthropic's shape.
With ``--tenants`` the router authenticates the API's requests and enforces every tenant limit
across its replicas (``make_router_gate``; the token limits with counts a replica makes:
``router/tenant_limits.py``); per-tenant series and the audit log as a server's (``tripod.tenants``).
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tripod import tracing
from tripod.asgi import BodyTooLarge, ClientGone, ClosingStream, read_body, until_disconnect
from tripod.console.app import Console
from tripod.router import lora
from tripod.router.console_source import RouterConsoleSource, SupervisorView
from tripod.router.errors import RouterError
from tripod.router.fairness import TENANT_HEADER
from tripod.router.prompt import is_anthropic, render_prompt
from tripod.router.replica import Replica
from tripod.router.router import Router
from tripod.router.stored import find_stored
from tripod.router.tenant_limits import OutputCount, TenantAdmission, settle_whole
from tripod.tenants import (
    COUNT_HEADER,
    AuditLog,
    OverLimit,
    RequestRecord,
    TenantGate,
    TenantRegistry,
    record_of,
)
from tripod.tenants.asgi import TenantMiddleware

log = logging.getLogger("tripod.router")

PROXIED_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens",
                 "/v1/responses", "/tokenize", "/detokenize")

Handler = Callable[[Request], Awaitable[Response]]


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


async def read_request(request: Request, limit: int) -> tuple[bytes, dict[str, Any]]:
    """A proxied request's body: its bytes (sent on unchanged) and the JSON object they hold (read
    for routing); a 413 past ``limit`` bytes, a 400 when it is not a JSON object."""
    try:
        raw = await read_body(request, limit)
    except BodyTooLarge:
        raise RouterError(413, f"the request body is larger than {limit} bytes; send a smaller one, or start the "
                          "router with a larger --max-body-bytes",
                          "request_too_large") from None
    return raw, json_object(raw)


def make_router_gate(router: Router) -> TenantGate:
    """The router's tenants: with ``--tenants`` it authenticates every API request itself (the file's
    keys, and the plain ``--api-key`` as the ``default`` tenant's) and enforces every limit for
    the whole fleet (the token limits with a replica's counts: ``router/tenant_limits.py``); the
    replicas, given the file too, attribute requests to the same tenants. Without ``--tenants``
    it checks no key (the replicas check theirs, as before), and every request is ``default``'s.
    ``TenantFileError``/``OSError`` on a bad file or audit path."""
    cfg = router.config
    registry = TenantRegistry(cfg.tenants, cfg.api_key if cfg.tenants else None)
    audit = (AuditLog(cfg.audit_log, content=cfg.audit_log_content, max_bytes=cfg.audit_log_max_bytes)
             if cfg.audit_log else None)
    router.weight_of = lambda name: _weight(registry, name)  # the router's fair share reads the file's weights
    return TenantGate(registry, router.metrics.tenants, audit)


def _weight(registry: TenantRegistry, name: str) -> float:
    tenant = registry.tenants().get(name)
    return tenant.weight if tenant is not None else 1.0


def check_tenant(gate: TenantGate, request: Request, body: dict[str, Any]) -> RequestRecord | None:
    """The request's tenant record, 404 for a model it may not use. Its limits are taken later
    (``router/tenant_limits.py``: ``TenantAdmission``, which ``Router.forward`` calls)."""
    rec = record_of(request.scope)
    if rec is None:
        return None
    model = body.get("model")
    if isinstance(model, str):
        rec.model = model
        try:
            gate.check_model(rec, model)
        except PermissionError as e:
            raise RouterError(404, f"{e}; see the tenant's 'models' in the tenants file", "model_not_found") from None
    if gate.audit is not None and gate.audit.content:
        rec.prompt = render_prompt(request.url.path, body)
    return rec


def count_usage(rec: RequestRecord | None, resp: Response) -> None:
    """A whole answer's token counts (OpenAI's or Anthropic's ``usage``) into its tenant record."""
    if rec is None or isinstance(resp, StreamingResponse) or resp.status_code != 200:
        return
    try:
        answer = json.loads(resp.body)
        usage = answer.get("usage") or {}
    except (ValueError, AttributeError):
        return
    if rec.model is None and isinstance(answer.get("model"), str):
        rec.model = answer["model"]  # the served model, for a request that named none
    if not isinstance(usage, dict):
        return
    prompt = usage.get("prompt_tokens", (usage.get("input_tokens") or 0) + (usage.get("cache_read_input_tokens") or 0))
    output = usage.get("completion_tokens", usage.get("output_tokens"))
    rec.prompt_tokens = prompt if isinstance(prompt, int) else 0
    rec.output_tokens = output if isinstance(output, int) else 0
    rec.output_known = rec.output_known or isinstance(output, int)


def tenant_headers(request: Request) -> dict[str, str]:
    """The request's headers with the tenant the router authenticated in ``x-tripod-tenant`` (a
    value the client sent is dropped: only the router names tenants)."""
    headers = {k: v for k, v in request.headers.items() if k.lower() not in (TENANT_HEADER, COUNT_HEADER)}
    rec = record_of(request.scope)
    if rec is not None:
        headers[TENANT_HEADER] = rec.identity.tenant.name
    return headers


async def forward_unless_gone(router: Router, request: Request, raw: bytes, body: dict[str, Any],
                              gate: TenantGate | None = None) -> Response:
    """``router.forward`` for this request (admitted into its tenant's limits by ``gate``), or 499
    when the client leaves first."""
    headers = tenant_headers(request)
    rec = record_of(request.scope)
    admit = TenantAdmission(gate, router, rec, request.url.path, raw, body, headers) \
        if gate is not None and rec is not None else None
    try:
        return await until_disconnect(request, router.forward(request.url.path, raw, body, headers, admit))
    except ClientGone:
        # NOTE: the client left while the router waited on a replica (a non-streamed answer, or a
        # stream before its first token): cancelling closes the upstream connection, and the
        # replica aborts the request and frees its KV.
        return Response(status_code=499)


def _counted(router: Router, route: str, fn: Handler) -> Handler:
    """``fn`` with the router's own errors answered (in Anthropic's shape on its routes) and every
    answer counted by route and status."""
    async def handler(request: Request) -> Response:
        try:
            resp = await fn(request)
        except RouterError as e:
            resp = e.response(anthropic=is_anthropic(request.url.path))
        router.metrics.http_requests.labels(route, str(resp.status_code)).inc()
        return resp
    return handler


async def _models(router: Router, request: Request) -> Response:
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


def _health(router: Router) -> Response:
    n = len(router.serving())  # (prefill replicas answer no request themselves)
    ok = n > 0 and not router.draining
    status = "draining" if router.draining else ("ok" if ok else "no routable replica")
    return JSONResponse({"status": status, "routable_replicas": n, "replicas": len(router.replicas)},
                        status_code=200 if ok else 503)


def _fleet(router: Router, fleet_info: Callable[[], dict[str, Any]] | None) -> Response:
    body: dict[str, Any] = {
        "policy": router.policy.name, "pending": router.pending, "queue_depth": router.queue_depth,
        "chars_per_token": round(router.chars_per_token, 3),
        "replicas": [r.describe() for r in router.replicas.values()],
        "pd": router.pd.describe(),  # prefill/decode hand-overs (router/pd.py)
        "kv_tiers": {key: {"tree_chars": t.size} for key, t in router.tiers.items()},  # shared disk tiers
    }
    if fleet_info is not None:
        body.update(fleet_info())
    return JSONResponse(body)


async def _not_found(request: Request, e: Exception) -> Response:
    code = e.status_code if isinstance(e, HTTPException) else 500
    msg = {404: "no such route; see /v1/models, /v1/chat/completions, /v1/completions, /v1/messages, /fleet, /ui",
           405: "this method is not allowed on this route"}.get(code, "internal error")
    return RouterError(code, msg, "not_found" if code == 404 else "bad_method").response(
        anthropic=is_anthropic(request.url.path))


def _api_path(path: str) -> bool:
    return (path in PROXIED_PATHS or path in lora.LORA_PATHS or path == "/v1/models" or path.startswith("/v1/models/")
            or path.startswith("/v1/responses/"))


def _finish_span(scope: Any, span: Any) -> None:
    tenant = tracing.tenant_of(scope)
    if tenant is not None:
        span.set_attribute("tripod.tenant", tenant)


def _over_limit(path: str, e: OverLimit) -> Any:
    return RouterError(429, str(e), "rate_limit_exceeded", int(e.retry_after_header)).response(
        anthropic=is_anthropic(path))


def _unauthorized(path: str, message: str) -> Any:
    return RouterError(401, message, "invalid_api_key").response(anthropic=is_anthropic(path))


def build_router_app(router: Router, lifespan: Any = None,
                     fleet_info: Callable[[], dict[str, Any]] | None = None,
                     supervisor: SupervisorView | None = None, gate: TenantGate | None = None) -> Starlette:
    """The router's app; ``supervisor`` (a fleet this process launched) adds the slots that are
    down and the autoscaler to the console's fleet view; ``gate``: its tenants (default: made from
    the config, see ``make_router_gate``)."""
    console = Console(RouterConsoleSource(router, supervisor), api_key=router.config.api_key,
                      bench_dir=router.config.bench_dir)
    tenants = gate or make_router_gate(router)

    async def proxied(request: Request) -> Response:
        raw, body = await read_request(request, router.config.max_body_bytes)
        rec = check_tenant(tenants, request, body)
        try:
            resp = await forward_unless_gone(router, request, raw, body, tenants)
        except RouterError:
            if rec is not None:
                rec.output_tokens, rec.output_known = 0, True  # nothing was answered: nothing used
            raise
        count_usage(rec, resp)
        settle_whole(rec, resp)
        if rec is not None and not rec.output_known and isinstance(resp, ClosingStream):
            OutputCount(rec, resp)
        return resp

    async def models(request: Request) -> Response:
        return await _models(router, request)

    async def stored(request: Request) -> Response:  # the replicas asked in turn (router/stored.py)
        return await find_stored(router, request, tenant_headers(request))

    async def lora_admin(request: Request) -> Response:  # to every replica (router/lora.py)
        raw, _ = await read_request(request, router.config.max_body_bytes)
        return await lora.broadcast(router, request.url.path, raw, dict(request.headers))

    async def health(_: Request) -> Response:
        return _health(router)

    async def metrics_page(_: Request) -> Response:
        page = router.metrics.render(router.replicas.values(), router.queue_depth, router.pending)
        return Response(page, media_type="text/plain; version=0.0.4")

    async def fleet(_: Request) -> Response:
        return _fleet(router, fleet_info)

    routes = [Route(p, _counted(router, p, proxied), methods=["POST"]) for p in PROXIED_PATHS]
    routes += [
        Route("/v1/models", _counted(router, "/v1/models", models), methods=["GET"]),
        Route("/v1/responses/{rid}", _counted(router, "/v1/responses/{id}", stored), methods=["GET", "DELETE"]),
        Route("/v1/responses/{rid}/input_items", _counted(router, "/v1/responses/{id}", stored), methods=["GET"]),
        Route("/v1/responses/{rid}/cancel", _counted(router, "/v1/responses/{id}", stored), methods=["POST"]),
        Route("/v1/models/{model_id:path}", _counted(router, "/v1/models", models), methods=["GET"]),
        *(Route(p, _counted(router, p, lora_admin), methods=["POST"]) for p in lora.LORA_PATHS),
        Route("/health", _counted(router, "/health", health), methods=["GET"]),
        Route("/metrics", metrics_page, methods=["GET"]),
        Route("/fleet", fleet, methods=["GET"]),
        *console.routes(),  # /ui: the console (tripod.console)
    ]
    traced = [Middleware(tracing.TraceMiddleware, component="router", traced=_api_path, finish=_finish_span)] \
        if tracing.ACTIVE else []  # outermost: the span covers the whole request (and the tenant's 401/429)
    guard = Middleware(TenantMiddleware, gate=tenants, refuse=_unauthorized, guarded=_api_path, attributed=_api_path,
                       route_of=lambda p: "/v1/models" if p.startswith("/v1/models") else
                       "/v1/responses/{id}" if p.startswith("/v1/responses/") else p,
                       limited=PROXIED_PATHS.__contains__, over_limit=_over_limit)

    @contextlib.asynccontextmanager
    async def with_tenants(app: Any) -> AsyncIterator[None]:
        try:
            async with contextlib.AsyncExitStack() as stack:
                if lifespan is not None:
                    await stack.enter_async_context(lifespan(app))
                await stack.enter_async_context(tenants.registry.watching())
                yield
        finally:
            tenants.close()

    return Starlette(routes=routes, lifespan=console.wrap_lifespan(with_tenants), middleware=[*traced, guard],
                     exception_handlers={HTTPException: _not_found})
