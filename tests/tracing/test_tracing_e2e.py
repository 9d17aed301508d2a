"""Tracing end to end (``tripod.tracing``): the SDK's in-memory span exporter sees one trace per
request, router → replica → engine, with the expected spans, parents and attributes — including an
answer whose replica fails mid-stream and is continued on another one.

One real ``tripod serve`` runs in this process (its app in a thread, its engine a real engine
process on the embedded model), behind a real router with tenants. The router's two replicas are
small pass-through proxies to that server (``CutProxy``) that can be told to drop a stream after a
few chunks, so that a failover continuation happens where the test wants it; a proxy makes no span
of its own and passes ``traceparent`` on, so the server's span is a child of the router's attempt.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tests.router.stubs import RouterServer, ServerThread, wait_for
from tests.support.inproc_server import InProcessServer
from tripod import tracing
from tripod.config import RouterConfig, ServerConfig

TENANTS = """
[[tenant]]
name = "acme"
keys = ["sk-acme-1"]
"""
KEY = "sk-acme-1"
MESSAGES = [{"role": "user", "content": "Name three colours."}]
ENGINE_SPANS = ("engine.queue", "engine.prefill", "engine.decode")


class CutProxy:
    """A replica that passes every request on to ``upstream`` (headers included), answering
    ``/health`` as a tripod replica that continues answers. While ``cut_after`` is set, a stream
    that is not a continuation is dropped after that many chunks (the connection cut)."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.cut_after: int | None = None
        self.cuts = 0
        self.client = httpx.AsyncClient(timeout=60)
        app = Starlette(routes=[
            Route("/health", self._health, methods=["GET"]),
            Route("/metrics", lambda _: Response("", media_type="text/plain"), methods=["GET"]),
            Route("/v1/chat/completions", self._post, methods=["POST"]),
        ])
        self.server = ServerThread(app, lifespan="off")
        self.url = self.server.url

    async def _health(self, _: Request) -> Response:
        return JSONResponse({"status": "ok", "continuation": True})

    async def _post(self, request: Request) -> Response:
        raw = await request.body()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
        req = self.client.build_request("POST", self.upstream + request.url.path, content=raw, headers=headers)
        resp = await self.client.send(req, stream=True)
        cut = self.cut_after if b'"tripod_continuation"' not in raw else None
        return StreamingResponse(self._relay(resp, cut), status_code=resp.status_code,
                                 media_type=resp.headers.get("content-type"))

    async def _relay(self, resp: httpx.Response, cut: int | None) -> AsyncIterator[bytes]:
        try:
            n = 0
            async for chunk in resp.aiter_raw():
                yield chunk
                n += chunk.count(b"data:")
                if cut is not None and n >= cut:
                    self.cuts += 1
                    raise RuntimeError("the proxy drops the connection (on purpose)")
        finally:
            await resp.aclose()

    def stop(self) -> None:
        self.server.stop(force=True)


@pytest.fixture(scope="module")
def exporter() -> Iterator[InMemorySpanExporter]:
    exp = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exp))
    tracing.use(provider)  # NOTE: before the apps are built: they add their middleware only when tracing is on
    try:
        yield exp
    finally:
        tracing.use(None)


@pytest.fixture(scope="module")
def stack(exporter: InMemorySpanExporter, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tenants = Path(tmp_path_factory.mktemp("tracing")) / "tenants.toml"
    tenants.write_text(TENANTS)
    made: list[Any] = []
    try:
        server = InProcessServer(ServerConfig(tenants=str(tenants), tenant_limits="tokens"))
        made.append(server)
        proxies = [CutProxy(server.url) for _ in range(2)]
        made.extend(proxies)
        router = RouterServer([("a", proxies[0].url), ("b", proxies[1].url)], RouterConfig(
            policy="round_robin", health_interval=0.1, health_timeout=1.0, metrics_interval=0.1, open_cooldown=0.2,
            queue_timeout=5.0, connect_timeout=2.0, request_timeout=60.0, retry_after=1, max_retries=2,
            tenants=str(tenants)))
        made.append(router)
        wait_for(lambda: all(r["state"] == "healthy" and r["continues"] for r in router.fleet()["replicas"]),
                 "both replicas routable")
        yield {"server": server, "proxies": proxies, "router": router}
    finally:
        for x in reversed(made):
            with contextlib.suppress(Exception):
                x.stop()


def client(router: RouterServer, request_id: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.url + "/v1", api_key=KEY, max_retries=0, timeout=120,
                         default_headers={"x-request-id": request_id})


def trace_of(exporter: InMemorySpanExporter, request_id: str) -> list[ReadableSpan]:
    """Every span of the trace whose router span carries ``request_id`` (waiting for the last spans:
    the server ends its span once the answer's last byte is sent)."""
    def spans() -> list[ReadableSpan] | None:
        roots = [s for s in exporter.get_finished_spans()
                 if s.name == "router.request" and s.attributes.get("tripod.request_id") == request_id]
        if not roots:
            return None
        assert len(roots) == 1, roots
        tid = roots[0].context.trace_id
        out = [s for s in exporter.get_finished_spans() if s.context.trace_id == tid]
        servers = [s for s in out if s.name == "server.request"]
        engine = [s for s in out if s.name == "engine.queue"]
        attempts = [s for s in out if s.name == "router.attempt"]
        return out if servers and len(servers) == len(attempts) and len(engine) == len(servers) else None

    return wait_for(spans, f"the spans of request {request_id}", timeout=30)


def one(spans: list[ReadableSpan], name: str, **attrs: Any) -> ReadableSpan:
    found = [s for s in spans if s.name == name and all(s.attributes.get(k) == v for k, v in attrs.items())]
    assert len(found) == 1, (name, attrs, [(s.name, dict(s.attributes)) for s in spans])
    return found[0]


def children(spans: list[ReadableSpan], parent: ReadableSpan) -> list[ReadableSpan]:
    return [s for s in spans if s.parent is not None and s.parent.span_id == parent.context.span_id]


def check_engine_spans(spans: list[ReadableSpan], server: ReadableSpan, decoded: bool = True) -> None:
    """Queue, prefill and decode under ``server``, one after the other, within it."""
    kids = {s.name: s for s in children(spans, server) if s.name in ENGINE_SPANS}
    assert set(kids) == set(ENGINE_SPANS), sorted(kids)
    q, p, d = (kids[n] for n in ENGINE_SPANS)
    assert q.end_time == p.start_time and p.end_time == d.start_time  # one timeline, cut where the engine said
    assert server.start_time <= q.start_time <= q.end_time <= p.end_time <= d.end_time <= server.end_time
    assert all(s.attributes["tripod.component"] == "engine" for s in (q, p, d))
    if decoded:
        assert d.attributes["tripod.output_tokens"] > 0


def test_one_trace_per_request_router_replica_engine(stack: dict[str, Any], exporter: InMemorySpanExporter) -> None:
    router = stack["router"]
    answers = [client(router, f"whole-{i}").chat.completions.create(
        model=stack["server"].model, messages=MESSAGES, max_tokens=8, temperature=0) for i in range(2)]
    assert all(a.choices[0].message.content for a in answers)
    traces = [trace_of(exporter, f"whole-{i}") for i in range(2)]
    assert traces[0][0].context.trace_id != traces[1][0].context.trace_id  # one trace per request
    for i, spans in enumerate(traces):
        assert sorted(s.name for s in spans) == sorted(
            ["router.request", "router.attempt", "server.request", *ENGINE_SPANS])
        assert len({s.context.trace_id for s in spans}) == 1
        root = one(spans, "router.request")
        assert root.parent is None
        assert root.attributes["tripod.tenant"] == "acme"
        assert root.attributes["http.route"] == "/v1/chat/completions"
        assert root.attributes["http.response.status_code"] == 200
        attempt = one(spans, "router.attempt")
        assert attempt.parent.span_id == root.context.span_id
        assert attempt.attributes["tripod.replica"] in ("a", "b")
        assert attempt.attributes["tripod.continuation"] is False
        server = one(spans, "server.request")
        assert server.parent.span_id == attempt.context.span_id  # across the process edge: traceparent
        assert server.attributes["tripod.request_id"] == f"whole-{i}"  # the client's x-request-id, passed on
        assert server.attributes["tripod.tenant"] == "acme"
        assert server.attributes["tripod.continuation"] is False
        assert server.attributes["gen_ai.usage.output_tokens"] == answers[i].usage.completion_tokens
        check_engine_spans(spans, server)
        assert all(s.status.status_code != StatusCode.ERROR for s in spans)


def test_failover_continuation_is_in_the_same_trace(stack: dict[str, Any], exporter: InMemorySpanExporter) -> None:
    router, proxies = stack["router"], stack["proxies"]
    for p in proxies:
        p.cut_after = 3  # whichever replica starts the answer drops it after 3 events
    try:
        stream = client(router, "failover-1").chat.completions.create(
            model=stack["server"].model, messages=MESSAGES, max_tokens=24, temperature=0, stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    finally:
        for p in proxies:
            p.cut_after = None
    assert text
    assert sum(p.cuts for p in proxies) == 1
    spans = trace_of(exporter, "failover-1")
    assert len({s.context.trace_id for s in spans}) == 1
    root = one(spans, "router.request")
    failed = one(spans, "router.attempt", **{"tripod.continuation": False})
    cont = one(spans, "router.attempt", **{"tripod.continuation": True})
    assert failed.parent.span_id == root.context.span_id and cont.parent.span_id == root.context.span_id
    assert failed.status.status_code == StatusCode.ERROR and "stream failed" in failed.status.description
    assert cont.status.status_code != StatusCode.ERROR
    assert cont.attributes["tripod.replica"] != failed.attributes["tripod.replica"]
    assert failed.end_time <= cont.start_time
    first = one(spans, "server.request", **{"tripod.continuation": False})
    second = one(spans, "server.request", **{"tripod.continuation": True})
    assert first.parent.span_id == failed.context.span_id
    assert second.parent.span_id == cont.context.span_id
    assert second.attributes["tripod.tenant"] == "acme" and second.attributes["tripod.request_id"] == "failover-1"
    check_engine_spans(spans, first, decoded=False)  # (cut mid-decode: its decode ends where the abort came)
    check_engine_spans(spans, second)
