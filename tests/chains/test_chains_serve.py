"""``tripod chains serve`` end to end, without models (``tests/chains/chain_apps/basic.py``): every
chainlet its own processes, calls between them over HTTP. What a call may meet is provoked for real:
a replica killed with SIGKILL in the middle of a call, a timeout, a client that walks away."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.server_helpers import TripodProcess
from tripod import chains
from tripod.chains.loader import load_file

APP = str(Path(__file__).parent / "chain_apps" / "basic.py")


@pytest.fixture(scope="module")
def writer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TripodProcess]:
    p = TripodProcess(tmp_path_factory.mktemp("chain-writer"), "chains", "serve", APP, start_timeout=90)
    yield p
    assert p.stop() == 0, p.log()[-4000:]  # SIGTERM: a clean drain


@pytest.fixture(scope="module")
def relay(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TripodProcess]:
    p = TripodProcess(tmp_path_factory.mktemp("chain-relay"), "chains", "serve", APP, "--entrypoint", "Relay",
                      start_timeout=90)
    yield p
    assert p.stop() == 0, p.log()[-4000:]


def _metric(url: str, name: str, **labels: str) -> float:
    """A sample of the chain server's merged /metrics, summed over the labels not given."""
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if not line.startswith(name + "{"):
            continue
        body, value = line.rsplit(" ", 1)
        got = dict(kv.split("=", 1) for kv in body[len(name) + 1: -1].split(","))
        if all(got.get(k) == json.dumps(v) for k, v in labels.items()):
            total += float(value)
    return total


def _wait_file(path: Path, timeout: float = 20.0) -> str:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.02)  # NOTE: the file is written by a chainlet process: poll, bounded
    return path.read_text()


def test_served_answers_equal_local_answers(writer: TripodProcess) -> None:
    module = load_file(APP)

    async def local() -> Any:
        with chains.run_local() as chain:
            out = await chain.handle(module.Writer).run(topic="tides", n=3)
            return [v.model_dump(mode="json") for v in out]

    served = httpx.post(writer.url + "/run", json={"topic": "tides", "n": 3}, timeout=30)
    assert served.status_code == 200, served.text
    assert served.json() == asyncio.run(local())
    health = httpx.get(writer.url + "/health", timeout=5).json()
    # NOTE: both Critic replicas count from the first 200 on: the chain server opens its port only
    # once every chainlet has all its declared replicas routable (ChainServer.wait_ready).
    assert health["status"] == "ok" and health["chainlets"] == {"Writer": 1, "Critic": 2}
    graph = httpx.get(writer.url + "/chain", timeout=5).json()
    assert graph["entrypoint"] == "Writer" and graph["chainlets"]["Critic"]["replicas"]["desired"] == 2
    assert graph["chainlets"]["Writer"]["dependencies"]["critic"] == {"chainlet": "Critic", "retries": 2,
                                                                      "timeout_s": 20, "replicas": 2}
    assert graph["chainlets"]["Writer"]["input_schema"]["required"] == ["topic"]


def test_validation_errors_are_400s_naming_the_field(writer: TripodProcess) -> None:
    r = httpx.post(writer.url + "/run", json={"topic": "tides", "n": "three"}, timeout=10)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "n" and err["code"] == "invalid_arguments" and "n:" in err["message"]
    r = httpx.post(writer.url + "/run", json={"n": 1, "colour": "red"}, timeout=10)
    assert r.status_code == 400 and {e["loc"][0] for e in r.json()["error"]["errors"]} == {"topic", "colour"}
    r = httpx.post(writer.url + "/run", content=b"{not json", timeout=10)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    # A chainlet that calls another wrongly: a 500 naming both and the field, never retried.
    r = httpx.post(writer.url + "/run", json={"topic": "t", "mode": "bad_call"}, timeout=10)
    assert r.status_code == 500
    err = r.json()["error"]
    assert err["path"] == ["Writer", "Critic"] and err["param"] == "hold_s" and err["retryable"] is False
    assert _metric(writer.url, "tripod:chainlet_retries_total", caller="Writer", cause="invalid_arguments") == 0


def _wait_routable(url: str, chainlet: str, n: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while httpx.get(url + "/health", timeout=5).json()["chainlets"][chainlet] < n:
        assert time.monotonic() < deadline, f"{chainlet} never had {n} routable replicas"
        time.sleep(0.2)  # NOTE: waiting for replicas to start (or restart), bounded


def test_a_replica_killed_mid_call_is_retried_and_the_call_succeeds(writer: TripodProcess, tmp_path: Path) -> None:
    _wait_routable(writer.url, "Critic", 2)
    before = _metric(writer.url, "tripod:chainlet_retries_total", caller="Writer", chainlet="Critic")
    with httpx.Client(timeout=60) as client:
        loop = asyncio.new_event_loop()
        try:
            fut = loop.run_in_executor(None, lambda: client.post(
                writer.url + "/run", json={"topic": "tides", "n": 1, "hold_s": 1.5, "scratch": str(tmp_path)}))
            pid = int(_wait_file(tmp_path / "Critic.pid"))
            (tmp_path / "Critic.pid").unlink()
            os.kill(pid, signal.SIGKILL)  # the replica dies while it holds the call
            r = loop.run_until_complete(fut)
        finally:
            loop.close()
    assert r.status_code == 200, r.text
    assert r.json() == [{"ok": False, "score": 6, "note": "1 words"}]
    assert int(_wait_file(tmp_path / "Critic.pid")) != pid  # the retry ran on another replica
    assert _metric(writer.url, "tripod:chainlet_retries_total", caller="Writer", chainlet="Critic",
                   cause="unavailable") >= before + 1
    _wait_routable(writer.url, "Critic", 2)  # the supervisor brought the lost replica back
    restarts = httpx.get(writer.url + "/chain", timeout=5).json()["chainlets"]["Critic"]["replicas"]["restarts"]
    assert sum(restarts.values()) >= 1


def test_a_timeout_is_a_clear_error_and_cancels_the_callee(writer: TripodProcess, tmp_path: Path) -> None:
    t0 = time.monotonic()
    r = httpx.post(writer.url + "/run", json={"topic": "t", "mode": "timeout", "hold_s": 30,
                                             "scratch": str(tmp_path)}, timeout=30)
    assert time.monotonic() - t0 < 10
    assert r.status_code == 504, r.text
    err = r.json()["error"]
    assert err["code"] == "timeout" and err["path"] == ["Writer", "Critic"]
    assert "timed out after 0.5 s" in err["message"] and "cancelled" in err["message"]
    _wait_file(tmp_path / "Critic.cancelled")  # the callee's work really stopped
    assert _metric(writer.url, "tripod:chainlet_calls_total", chainlet="Critic", outcome="cancelled") >= 1


def _open_stream(url: str, body: dict[str, Any]) -> tuple[socket.socket, Any]:
    """A raw HTTP/1.1 streaming POST (so the test controls exactly when the connection closes)."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    data = json.dumps(body).encode()
    sock.sendall(b"POST /run HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
                 + str(len(data)).encode() + b"\r\n\r\n" + data)
    return sock, sock.makefile("rb")


def _next_item(f: Any) -> Any:
    """The next SSE item's JSON from a chunked response (chunk-size lines are skipped)."""
    while True:
        line = f.readline()
        assert line, "the stream ended"
        if line.startswith(b"data: "):
            return json.loads(line[6:])


def test_a_stream_delivers_its_first_item_before_the_last_is_produced(relay: TripodProcess, tmp_path: Path) -> None:
    sock, f = _open_stream(relay.url, {"n": 3, "scratch": str(tmp_path), "gate": True})
    try:
        assert f.readline().startswith(b"HTTP/1.1 200")
        assert _next_item(f) == "tick 0"
        # Ticker is now blocked before producing tick 1 until the test lets it go.
        _wait_file(tmp_path / "Ticker.first-sent")
        (tmp_path / "go").write_text("")
        assert _next_item(f) == "tick 1" and _next_item(f) == "tick 2"
        assert _next_item(f) == {"items": 3}  # event: end
    finally:
        sock.close()


def test_a_client_disconnect_cancels_the_whole_call_tree(relay: TripodProcess, tmp_path: Path) -> None:
    before = _metric(relay.url, "tripod:chainlet_calls_total", chainlet="Ticker", outcome="cancelled")
    sock, f = _open_stream(relay.url, {"n": 3, "scratch": str(tmp_path), "gate": True})
    assert f.readline().startswith(b"HTTP/1.1 200")
    assert _next_item(f) == "tick 0"
    _wait_file(tmp_path / "Ticker.first-sent")
    f.close()
    sock.close()  # the client leaves mid-stream: Relay, and Relay's call to Ticker, are cancelled
    _wait_file(tmp_path / "Ticker.cancelled")
    deadline = time.monotonic() + 10
    while _metric(relay.url, "tripod:chainlet_calls_total", chainlet="Ticker", outcome="cancelled") < before + 1:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert _metric(relay.url, "tripod:chainlet_calls_total", chainlet="Relay", outcome="cancelled") >= 1
    assert _metric(relay.url, "tripod:chainlet_inflight", chainlet="Ticker") == 0


def test_streamed_answer_over_sse(relay: TripodProcess) -> None:
    with httpx.stream("POST", relay.url + "/run", json={"n": 2}, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines == ['data: "tick 0"', 'data: "tick 1"', "event: end", 'data: {"items":2}']
    r = httpx.post(relay.url + "/run", json={"n": -1.5}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
