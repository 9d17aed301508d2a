"""OpenTelemetry tracing: one trace per request, router → replica → engine, across chain hops.

Off by default. ``--otel-endpoint URL`` (OTLP over HTTP; needs the optional
``opentelemetry-exporter-otlp-proto-http``) or ``--otel-file FILE`` (one JSON span per line) turns
it on for a process (``configure``); tests install a tracer provider of their own (``use``). Every
process's spans carry ``tripod.component`` (router, server, chains) and, on the request's span,
``tripod.request_id`` (the client's ``x-request-id``, else one made here and passed on) and
``tripod.tenant``.

The spans of a request:

- ``router.request`` (the router's app) with one ``router.attempt`` per replica tried; an attempt
  that continues an answer a failed replica had begun has ``tripod.continuation`` = true;
- ``server.request`` (a replica's app; its parent is the attempt that called it, from the W3C
  ``traceparent`` header the router sends), with ``engine.queue`` (added → admitted),
  ``engine.prefill`` (admitted → first token) and ``engine.decode`` (first token → finished) per
  sequence, from the times the engine process reports (``engine_ipc.SeqTiming``);
- ``chains.request`` / ``chains.call`` for a chain's HTTP hops (each call sends ``traceparent``).

NOTE: zero cost when off. Nothing here is imported from ``opentelemetry`` until tracing is turned
on; the apps add their middleware only when it is on; elsewhere each hook is one ``if`` on a
module global (``ACTIVE``), and the engine process reports times only when asked at launch.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("tripod.tracing")

ACTIVE = False  # NOTE: read on hot paths instead of calling anything: keep it a plain bool
_tracer: Any = None
_provider: Any = None

REQUEST_ID_HEADER = "x-request-id"
SCOPE_KEY = "tripod.trace"  # the request's span, in the ASGI scope


class TracingUnavailable(RuntimeError):
    """Tracing was asked for but what it needs is not installed (the message says what to install)."""


def configure(service: str, endpoint: str | None = None, file: str | None = None) -> bool:
    """Turn tracing on for this process when ``endpoint`` (OTLP/HTTP) or ``file`` is given; returns
    whether it is on. ``TracingUnavailable`` when the SDK or the OTLP exporter is missing."""
    if not endpoint and not file:
        return False
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
    except ImportError as e:
        raise TracingUnavailable(f"tracing needs the OpenTelemetry SDK ({e}); pip install opentelemetry-sdk") from None
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    if endpoint:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:
            raise TracingUnavailable(
                "--otel-endpoint needs the OTLP exporter: pip install opentelemetry-exporter-otlp-proto-http "
                "(or use --otel-file FILE)") from None
        url = endpoint if endpoint.rstrip("/").endswith("/v1/traces") else endpoint.rstrip("/") + "/v1/traces"
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=url)))
    if file:
        out = open(file, "a", buffering=1)
        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter(
            out=out, formatter=lambda span: span.to_json(indent=None) + "\n")))
    use(provider)
    log.info("tracing on: service %s, spans to %s", service, " and ".join(x for x in (endpoint, file) if x))
    return True


def use(provider: Any) -> None:
    """Trace with ``provider`` (an SDK ``TracerProvider``), or turn tracing off (None). The
    process-wide switch: ``configure`` calls it; tests call it with an in-memory exporter."""
    global ACTIVE, _tracer, _provider
    if provider is None:
        ACTIVE, _tracer, _provider = False, None, None
        return
    _provider = provider
    _tracer = provider.get_tracer("tripod")
    ACTIVE = True


def shutdown() -> None:
    """Flush and stop the exporters (at process exit)."""
    if _provider is not None:
        _provider.shutdown()


# ---------------------------------------------------------------------- spans
def start_span(name: str, *, parent: Any = None, kind: str = "internal", start_ns: int | None = None,
               attributes: Mapping[str, Any] | None = None) -> Any:
    """A started span (end it with ``end``): a child of ``parent`` (a span), else of the current one."""
    from opentelemetry import trace

    ctx = trace.set_span_in_context(parent) if parent is not None else None
    return _tracer.start_span(name, context=ctx, kind=getattr(trace.SpanKind, kind.upper()),
                              attributes=dict(attributes or {}), start_time=start_ns)


def end(span: Any, *, error: str | None = None, end_ns: int | None = None) -> None:
    if span is None:
        return
    if error is not None:
        from opentelemetry.trace import Status, StatusCode

        span.set_status(Status(StatusCode.ERROR, error))
    span.end(end_time=end_ns)


@contextmanager
def current(span: Any) -> Iterator[None]:
    """Make ``span`` the current span inside the block (children made there are its children)."""
    from opentelemetry import trace

    with trace.use_span(span, end_on_exit=False):
        yield


def inject(headers: dict[str, str], span: Any = None) -> dict[str, str]:
    """``headers`` plus the W3C ``traceparent`` of ``span`` (else the current span): a new dict."""
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    out = dict(headers)
    ctx = trace.set_span_in_context(span) if span is not None else None
    TraceContextTextMapPropagator().inject(out, context=ctx)
    return out


def extract(headers: Mapping[str, str]) -> Any:
    """The remote parent a request's ``traceparent`` names (an OpenTelemetry context), or None."""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract(headers)


def monotonic_to_ns(t: float) -> int:
    """A ``time.monotonic()`` reading (this machine's CLOCK_MONOTONIC, which the engine process
    shares) as a wall-clock time in ns, the unit spans take."""
    return time.time_ns() - time.monotonic_ns() + int(t * 1e9)


# ---------------------------------------------------------------------- ASGI
class TraceMiddleware:
    """Pure ASGI: a ``<component>.request`` span around each request on ``traced`` paths, a child
    of the caller's ``traceparent`` when it sends one, with the request id (``x-request-id``, made
    here when absent and then added to the request's headers so a proxy passes it on), the route
    and the status; ``finish(scope, span)`` adds what the app learned (the tenant, engine spans).
    Installed only when tracing is on."""

    def __init__(self, app: ASGIApp, component: str, traced: Any, finish: Any = None) -> None:
        self.app = app
        self.component = component
        self.traced = traced
        self.finish = finish

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not ACTIVE or not self.traced(scope["path"]):
            await self.app(scope, receive, send)
            return
        from opentelemetry import trace

        raw = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers") or ()}
        rid = raw.get(REQUEST_ID_HEADER)
        if not rid:
            rid = uuid.uuid4().hex
            scope["headers"] = [*scope.get("headers", ()), (REQUEST_ID_HEADER.encode(), rid.encode())]
        span = _tracer.start_span(
            f"{self.component}.request", context=extract(raw), kind=trace.SpanKind.SERVER,
            attributes={"tripod.component": self.component, "tripod.request_id": rid,
                        "http.request.method": scope.get("method", ""), "http.route": scope["path"]})
        scope[SCOPE_KEY] = span
        status = [0]

        async def traced_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        error: str | None = None
        try:
            with trace.use_span(span, end_on_exit=False):
                await self.app(scope, receive, traced_send)
        except BaseException as e:
            error = f"{type(e).__name__}: {e}"
            raise
        finally:
            span.set_attribute("http.response.status_code", status[0])
            if self.finish is not None:
                try:
                    self.finish(scope, span)
                except Exception:  # tracing must never fail a request
                    log.exception("tracing: could not finish the span of %s", scope["path"])
            if error is None and status[0] >= 500:
                error = f"status {status[0]}"
            end(span, error=error)


def tenant_of(scope: Scope) -> str | None:
    """The tenant ``tripod.tenants`` attributed the request to (None: not attributed)."""
    from tripod.tenants import record_of

    rec = record_of(scope)
    return rec.identity.tenant.name if rec is not None else None
