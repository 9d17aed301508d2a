"""Under load and faults: API keys, a full queue, SIGTERM drain, a dead engine.

Each scenario runs its own real ``tripod serve`` (the drain and dead-engine ones end it).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.support.server_helpers import ServerProcess

KEY = "s3cret-key-for-tests"
LONG_STREAM = {"prompt": "Tell me a long story.", "max_tokens": 400, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = ServerProcess(
        tmp_path_factory.mktemp("keyed"), "--max-running", "2", "--max-waiting", "1", api_key=KEY
    )
    try:
        yield srv
    finally:
        srv.stop()


@pytest.mark.slow
def test_api_key_required_and_checked(keyed: ServerProcess) -> None:
    before = keyed.engine_stats()
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"}):
        for method, path in (("POST", "/v1/chat/completions"), ("GET", "/v1/models"), ("POST", "/v1/completions")):
            r = httpx.request(method, keyed.url + path, json=body, headers=headers)
            assert r.status_code == 401, (headers, path, r.text)
            assert r.json()["error"]["code"] == "invalid_api_key"
    bad = openai.OpenAI(base_url=f"{keyed.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"}])
    # Nothing of that reached the engine.
    after = keyed.engine_stats()
    assert after["prompt_tokens"] == before["prompt_tokens"]
    assert after["generated_tokens"] == before["generated_tokens"]
    # /health stays open; the right key works, through the official client too.
    assert httpx.get(f"{keyed.url}/health").status_code == 200
    good = openai.OpenAI(base_url=f"{keyed.url}/v1", api_key=KEY, max_retries=0)
    r = good.chat.completions.create(model=good.models.list().data[0].id, max_tokens=3,
                                     messages=[{"role": "user", "content": "hi"}])
    assert r.usage is not None and r.usage.completion_tokens >= 1


def test_queue_overflow_gives_429_with_retry_after(keyed: ServerProcess) -> None:
    """max_running 2 + max_waiting 1: of 8 concurrent long requests, 3 are served, 5 refused."""

    async def main() -> list[tuple[int, str, dict[str, str]]]:
        async with httpx.AsyncClient(base_url=keyed.url, headers=keyed.headers, timeout=120) as c:
            async def one(i: int) -> tuple[int, str, dict[str, str]]:
                async with c.stream("POST", "/v1/completions", json={**LONG_STREAM, "max_tokens": 120}) as r:
                    text = "".join([line async for line in r.aiter_lines()])
                    return r.status_code, text, dict(r.headers)

            return await asyncio.gather(*(one(i) for i in range(8)))

    results = asyncio.run(main())
    codes = sorted(code for code, _, _ in results)
    assert codes == [200] * 3 + [429] * 5, codes
    for code, text, headers in results:
        if code == 429:
            assert headers["retry-after"] == "1"
            assert json.loads(text)["error"]["code"] == "overloaded"
        else:
            assert text.endswith("data: [DONE]")
            assert '"finish_reason":"length"' in text
    s = keyed.wait_idle()
    assert s["consistent"] is True and s["kv_pinned"] == 0
    # Once the queue drained, requests are accepted again.
    r = httpx.post(f"{keyed.url}/v1/completions", headers=keyed.headers, json={"prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200


def test_anthropic_auth_by_x_api_key(keyed: ServerProcess) -> None:
    import anthropic

    body = {"model": "default", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    for headers in ({}, {"x-api-key": "wrong"}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(f"{keyed.url}/v1/messages", json=body, headers=headers)
        assert r.status_code == 401, (headers, r.text)
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == "authentication_error"
    bad = anthropic.Anthropic(base_url=keyed.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        bad.messages.create(**body)
    good = anthropic.Anthropic(base_url=keyed.url, api_key=KEY, max_retries=0)
    m = good.messages.create(**body)
    assert m.usage.output_tokens >= 1
    assert good.messages.count_tokens(model="default", messages=body["messages"]).input_tokens > 0
    # Either header works on every guarded route; /health stays open.
    assert httpx.get(f"{keyed.url}/v1/models", headers={"x-api-key": KEY}).status_code == 200
    assert httpx.get(f"{keyed.url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def test_anthropic_full_server_answers_529_overloaded(keyed: ServerProcess) -> None:
    """The same full queue as above: Anthropic's 529 overloaded_error, with Retry-After."""
    body = {"model": "default", "max_tokens": 24, "ignore_eos": True, "stream": True,
            "messages": [{"role": "user", "content": "Tell me a long story."}]}

    async def main() -> list[tuple[int, str, dict[str, str]]]:
        async with httpx.AsyncClient(base_url=keyed.url, headers={"x-api-key": KEY}, timeout=120) as c:
            async def one(i: int) -> tuple[int, str, dict[str, str]]:
                async with c.stream("POST", "/v1/messages", json=body) as r:
                    text = "".join([line + "\n" async for line in r.aiter_lines()])
                    return r.status_code, text, dict(r.headers)

            return await asyncio.gather(*(one(i) for i in range(8)))

    results = asyncio.run(main())
    codes = sorted(code for code, _, _ in results)
    assert codes == [200] * 3 + [529] * 5, codes
    for code, text, headers in results:
        if code == 529:
            assert headers["retry-after"] == "1"
            assert json.loads(text) == {"type": "error", "error": {"type": "overloaded_error",
                                                                   "message": json.loads(text)["error"]["message"]}}
        else:
            assert "event: message_stop" in text and '"stop_reason":"max_tokens"' in text
    s = keyed.wait_idle()
    assert s["consistent"] is True and s["kv_pinned"] == 0


@pytest.mark.slow
def test_sigterm_drains_in_flight_then_exits_0(tmp_path: Path) -> None:
    srv = ServerProcess(tmp_path, "--drain-timeout", "60")
    try:
        lines: list[str] = []
        got_first = threading.Event()

        def stream() -> None:
            with httpx.stream("POST", f"{srv.url}/v1/completions", timeout=120,
                              json={**LONG_STREAM, "max_tokens": 150, "stream_options": {"include_usage": True}}) as r:
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                        got_first.set()

        t = threading.Thread(target=stream)
        t.start()
        assert got_first.wait(60)
        srv.signal(signal.SIGTERM)
        # New work is refused from now on (503 while draining, or the port is closed).
        deadline = time.monotonic() + 10
        while True:
            try:
                h = httpx.get(f"{srv.url}/health", timeout=5)
                refused = h.status_code == 503
            except httpx.TransportError:
                refused = True
            if refused:
                break
            assert time.monotonic() < deadline, "the server kept reporting healthy after SIGTERM"
            time.sleep(0.05)
        try:
            r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=5)
            assert r.status_code == 503 and r.headers["retry-after"]
        except httpx.TransportError:
            pass
        t.join(120)
        assert lines[-1] == "data: [DONE]"
        usage = json.loads(lines[-2].removeprefix("data: "))["usage"]
        assert usage["completion_tokens"] == 150  # the in-flight request finished whole
        assert srv.wait_exit(60) == 0, srv.log()
    finally:
        srv.stop()


@pytest.mark.slow
def test_engine_death_fails_health_and_requests_and_exits_nonzero(tmp_path: Path) -> None:
    srv = ServerProcess(tmp_path)
    try:
        pid = httpx.get(f"{srv.url}/health").json()["engine_pid"]
        result: dict[str, Any] = {}
        started = threading.Event()

        def waiting_request() -> None:
            body = {"prompt": "Tell me a long story.", "max_tokens": 2000, "ignore_eos": True}
            started.set()
            result["response"] = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=120)

        t = threading.Thread(target=waiting_request)
        t.start()
        started.wait()
        deadline = time.monotonic() + 30
        while httpx.get(f"{srv.url}/health").json()["running"] < 1:  # heartbeat shows it running
            assert time.monotonic() < deadline
            time.sleep(0.05)
        os.kill(pid, signal.SIGKILL)
        t.join(60)
        r = result["response"]
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "engine_dead"
        try:
            assert httpx.get(f"{srv.url}/health", timeout=5).status_code == 503
        except httpx.TransportError:
            pass  # already exited: health fails either way
        assert srv.wait_exit(60) != 0
        assert "engine process exited" in srv.log()
    finally:
        srv.stop()
