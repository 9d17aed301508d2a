"""``tripod.tracing`` without a model: off by default and then invisible (no middleware, no
``traceparent`` sent on, no engine times asked for), ``--otel-file`` writes spans as JSON lines, and
an OTLP endpoint without its exporter installed is refused at start-up saying what to install.
A router over a stub replica (real HTTP) stands in for the fleet."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.router.stubs import RouterServer, Stub, wait_for
from tripod import tracing
from tripod.config import EngineConfig, RouterConfig
from tripod.protocol import engine_ipc

SETTINGS = dict(policy="round_robin", health_interval=0.1, health_timeout=1.0, metrics_interval=0.1,
                open_cooldown=0.2, queue_timeout=2.0, connect_timeout=2.0, request_timeout=10.0, retry_after=1)


@pytest.fixture
def stub() -> Iterator[Stub]:
    s = Stub("s")
    yield s
    s.stop()


def router_over(stub: Stub) -> RouterServer:
    rs = RouterServer([("s", stub.url)], RouterConfig(**SETTINGS))  # type: ignore[arg-type]
    wait_for(lambda: rs.states().get("s") == "healthy", "the stub routable")
    return rs


def test_off_by_default_nothing_is_traced_or_propagated(stub: Stub) -> None:
    assert not tracing.ACTIVE
    assert not tracing.configure("tripod-router")  # no endpoint, no file: stays off
    assert not tracing.ACTIVE
    rs = router_over(stub)
    try:
        app = rs.server.server.config.app
        assert not any(m.cls is tracing.TraceMiddleware for m in app.user_middleware)
        r = rs.post(stream=False)
        assert r.status_code == 200
        assert "traceparent" not in stub.headers[-1]
        assert "x-request-id" not in stub.headers[-1]  # (made only by a tracing router)
    finally:
        rs.stop()


def test_engine_times_are_asked_for_only_when_tracing() -> None:
    launch = engine_ipc.decode_launch(engine_ipc.encode_launch(engine_ipc.EngineLaunch(
        engine_config=EngineConfig(), to_engine="ipc://a",
        from_engine="ipc://b", heartbeat_interval=0.5, log_level=20, parent_pid=1)))
    assert launch.timings is False
    out = engine_ipc.decode(engine_ipc.encode(engine_ipc.Outputs([engine_ipc.SeqOutput(rid="r", index=0, token_ids=[1])])))
    assert isinstance(out, engine_ipc.Outputs) and out.items[0].timing is None
    timed = engine_ipc.SeqOutput(rid="r", index=0, token_ids=[1], timing=engine_ipc.SeqTiming(1.0, 2.0, 3.0, None))
    back = engine_ipc.decode(engine_ipc.encode(engine_ipc.Outputs([timed])))
    assert isinstance(back, engine_ipc.Outputs) and back.items[0].timing == engine_ipc.SeqTiming(1.0, 2.0, 3.0, None)


def test_otel_file_gets_the_router_spans_and_the_replica_gets_traceparent(stub: Stub, tmp_path: Path) -> None:
    path = tmp_path / "spans.jsonl"
    assert tracing.configure("tripod-router", file=str(path))
    try:
        rs = router_over(stub)
        try:
            r = rs.http.post("/v1/chat/completions", headers={"x-request-id": "req-7"},
                             json={"model": "stub-model", "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 200
        finally:
            rs.stop()
        sent = stub.headers[-1]
        tracing.shutdown()  # flushes the batch
    finally:
        tracing.use(None)
    spans = [json.loads(line) for line in path.read_text().splitlines()]
    by_name = {s["name"]: s for s in spans}
    assert set(by_name) == {"router.request", "router.attempt"}
    root, attempt = by_name["router.request"], by_name["router.attempt"]
    assert root["attributes"]["tripod.request_id"] == "req-7"
    assert root["resource"]["attributes"]["service.name"] == "tripod-router"
    assert attempt["parent_id"] == root["context"]["span_id"]
    assert attempt["attributes"]["tripod.replica"] == "s"
    # The replica is told the attempt's span: W3C traceparent 00-<trace id>-<span id>-<flags>.
    _, trace_id, parent_id, _ = sent["traceparent"].split("-")
    assert "0x" + trace_id == root["context"]["trace_id"] and "0x" + parent_id == attempt["context"]["span_id"]
    assert sent["x-request-id"] == "req-7"


def _otlp_installed() -> bool:
    try:
        return importlib.util.find_spec("opentelemetry.exporter.otlp.proto.http") is not None
    except ModuleNotFoundError:
        return False


@pytest.mark.skipif(_otlp_installed(), reason="the OTLP exporter is installed here")
def test_otlp_endpoint_without_the_exporter_is_refused_at_start_up() -> None:
    with pytest.raises(tracing.TracingUnavailable, match="pip install opentelemetry-exporter-otlp-proto-http"):
        tracing.configure("tripod-router", endpoint="http://127.0.0.1:4318")
    assert not tracing.ACTIVE
    r = subprocess.run([sys.executable, "-m", "tripod.cli", "route", "--replica", "http://127.0.0.1:9",
                        "--otel-endpoint", "http://127.0.0.1:4318", "--port", "0"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "opentelemetry-exporter-otlp-proto-http" in r.stderr


def test_the_router_fair_share_queue_has_its_span(stub: Stub) -> None:
    """With ``--replica-max-inflight`` the router's fair-share queue is a span of its own under the
    request's, with the tenant and whether a place came."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exp = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exp))
    tracing.use(provider)
    try:
        rs = RouterServer([("s", stub.url)], RouterConfig(**{**SETTINGS, "replica_max_inflight": 1}))  # type: ignore[arg-type]
        wait_for(lambda: rs.states().get("s") == "healthy", "the stub routable")
        try:
            r = rs.http.post("/v1/chat/completions", json={"model": "stub-model",
                                                           "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 200
        finally:
            rs.stop()
    finally:
        tracing.use(None)
    by_name = {s.name: s for s in exp.get_finished_spans()}
    assert {"router.request", "router.queue", "router.attempt"} <= set(by_name)
    queue, root = by_name["router.queue"], by_name["router.request"]
    assert queue.parent is not None and queue.parent.span_id == root.context.span_id
    assert queue.context.trace_id == root.context.trace_id
    assert queue.attributes is not None and queue.attributes["tripod.admitted"] is True
    assert queue.attributes["tripod.tenant"] == "default"


@pytest.mark.skipif(not _otlp_installed(), reason="the OTLP exporter is not installed here (optional)")
def test_otlp_endpoint_exports_to_a_collector() -> None:
    """With the exporter installed, ``--otel-endpoint`` POSTs OTLP/HTTP to ``<endpoint>/v1/traces``
    (a collector on loopback that records what it receives)."""
    import http.server
    import threading

    got: list[tuple[str, str, bytes]] = []

    class Collector(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # (the stdlib names it)
            body = self.rfile.read(int(self.headers.get("content-length", 0)))
            got.append((self.path, self.headers.get("content-type", ""), body))
            self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        assert tracing.configure("tripod-router", endpoint=f"http://127.0.0.1:{srv.server_address[1]}")
        try:
            tracing.end(tracing.start_span("router.request", attributes={"tripod.request_id": "otlp-1"}))
            tracing.shutdown()  # flushes the batch to the collector
        finally:
            tracing.use(None)
    finally:
        srv.shutdown()
    assert got and got[0][0] == "/v1/traces" and got[0][1] == "application/x-protobuf"
    assert b"router.request" in got[0][2] and b"otlp-1" in got[0][2]
