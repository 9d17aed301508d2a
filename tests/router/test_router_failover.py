"""The router's mid-answer failover over real HTTP, against stub replicas that speak tripod's
failover protocol (resume points in stream chunks, progress streams for whole answers,
continuations): cut streams, 5xx error events, stalls, whole answers, held chunks of a delta, and
the continuation budget. The stubs answer a fixed sequence of tokens (token i is the text
``"t<i> "``) and continue from the tokens a continuation carries, so the whole answer is known
exactly; they check what the router sends them (the resume points the client really has).

(The same with real tripod replicas killed mid-answer: tests/router/test_failover_e2e.py.)
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx
import openai
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tests.router.stubs import MODEL, RouterServer, ServerThread, wait_event, wait_for
from tripod.config import RouterConfig

N_TOKENS = 12
CHAT = [{"role": "user", "content": "Count."}]


def word(t: int) -> str:
    return f"t{t} "


def full_text(n: int = N_TOKENS) -> str:
    return "".join(word(t) for t in range(n))


def sse(obj: Any, event: str | None = None) -> bytes:
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class TripodStub:
    """A replica speaking tripod's failover protocol. ``fail`` (read per request): ``None``
    (answer fully), ``("cut", k)`` (drop the connection after k tokens), ``("error", k)`` (a 5xx
    error event after k tokens), ``("stall", k)`` (go silent after k tokens), ``("split", k)`` (the
    delta of token k comes as two chunks, and the connection drops between them). ``shared`` (by
    the stubs of a test), for whichever stub gets the next continuation: ``refusals`` (how many
    continuations to answer 503) and ``fail_continuation`` (its ``fail``). Every POST body is kept."""

    def __init__(self, name: str, shared: dict[str, Any]) -> None:
        self.name = name
        self.fail: tuple[str, int] | None = None
        self.shared = shared
        self.bodies: list[dict[str, Any]] = []
        self.release = threading.Event()
        app = Starlette(routes=[
            Route("/health", self._health, methods=["GET"]),
            Route("/metrics", lambda _: Response("", media_type="text/plain"), methods=["GET"]),
            Route("/v1/chat/completions", self._post, methods=["POST"]),
            Route("/v1/completions", self._post, methods=["POST"]),
        ])
        self.server = ServerThread(app, lifespan="off")
        self.url = self.server.url

    async def _health(self, _: Request) -> Response:
        return JSONResponse({"status": "ok", "continuation": True})

    async def _post(self, request: Request) -> Response:
        body = await request.json()
        self.bodies.append(body)
        fail, self.fail = self.fail, None  # one failure per arming
        cont = body.get("tripod_continuation")
        if cont and self.shared["fail_continuation"] is not None:
            fail, self.shared["fail_continuation"] = self.shared["fail_continuation"], None
        if cont and self.shared["refusals"] > 0:
            self.shared["refusals"] -= 1
            return JSONResponse({"error": {"message": "no", "type": "server_error", "param": None, "code": "x"}},
                                status_code=503)
        start = {c["index"]: len(c["token_ids"]) for c in cont["choices"]} if cont else {}
        rid, created = (cont["id"], cont["created"]) if cont else (f"chatcmpl-{self.name}", 1000)
        if cont and body.get("stream"):
            c0 = next(c for c in cont["choices"] if c["index"] == 0)
            # The resume point is exactly what the client has: the words of the tokens sent.
            assert c0["chars"] == len(full_text(len(c0["token_ids"]))), c0
            assert c0["token_ids"] == list(range(len(c0["token_ids"])))
        first = start.get(0, 0)
        if not body.get("stream"):
            if not body.get("tripod_failover"):
                return JSONResponse(self._answer(rid, created, list(range(N_TOKENS))))
            return StreamingResponse(self._progress(rid, created, first, fail), media_type="text/event-stream")
        return StreamingResponse(self._stream(rid, created, first, cont is not None, fail),
                                 media_type="text/event-stream")

    def _answer(self, rid: str, created: int, tokens: list[int]) -> dict[str, Any]:
        return {"id": rid, "object": "chat.completion", "created": created, "model": MODEL,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": full_text()},
                             "finish_reason": "length", "logprobs": None}],
                "usage": {"prompt_tokens": 3, "completion_tokens": len(tokens), "total_tokens": 3 + len(tokens)},
                "served_by": self.name}

    def _chunk(self, rid: str, created: int, delta: dict[str, Any], mark: dict[str, Any] | None,
               finish: str | None = None) -> bytes:
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        if mark is not None:
            choice["tripod"] = mark
        return sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": MODEL,
                    "choices": [choice]})

    async def _stream(self, rid: str, created: int, first: int, continued: bool,
                      fail: tuple[str, int] | None) -> AsyncIterator[bytes]:
        if not continued:
            yield self._chunk(rid, created, {"role": "assistant", "content": ""}, {"token_ids": [], "chars": 0})
        for t in range(first, N_TOKENS):
            if fail is not None and t == fail[1]:
                if fail[0] == "error":
                    yield sse({"error": {"message": "the engine stopped", "type": "server_error", "param": None,
                                         "code": "engine_dead"}})
                    yield b"data: [DONE]\n\n"
                    return
                if fail[0] == "stall":
                    await wait_event(self.release, 20)
                    return
                if fail[0] == "split":
                    yield self._chunk(rid, created, {"content": word(t)[:2]}, None)  # no resume point: held
                raise RuntimeError("the stub drops the connection (on purpose)")
            finish = "length" if t == N_TOKENS - 1 else None
            yield self._chunk(rid, created, {"content": word(t)},
                              {"token_ids": [t], "chars": len(full_text(t + 1))}, finish)
            await asyncio.sleep(0.005)
        yield sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": MODEL, "choices": [],
                   "usage": {"prompt_tokens": 3, "completion_tokens": N_TOKENS, "total_tokens": 3 + N_TOKENS}})
        yield b"data: [DONE]\n\n"

    async def _progress(self, rid: str, created: int, first: int,
                        fail: tuple[str, int] | None) -> AsyncIterator[bytes]:
        for t in range(first, N_TOKENS):
            if fail is not None and t == fail[1]:
                raise RuntimeError("the stub drops the connection (on purpose)")
            yield sse({"id": rid, "created": created, "index": 0, "token_ids": [t], "logprobs": [[t, -0.5, []]],
                       "finish_reason": "length" if t == N_TOKENS - 1 else None}, event="progress")
        yield sse(self._answer(rid, created, list(range(N_TOKENS))), event="result")

    def stop(self) -> None:
        self.release.set()
        self.server.stop(force=True)


@pytest.fixture
def fleet() -> Iterator[Callable[..., tuple[RouterServer, list[TripodStub]]]]:
    made: list[Any] = []

    def make(n: int = 2, refusals: int = 0, **overrides: Any) -> tuple[RouterServer, list[TripodStub]]:
        shared: dict[str, Any] = {"refusals": refusals, "fail_continuation": None}
        stubs = [TripodStub(f"stub-{chr(97 + i)}", shared) for i in range(n)]
        settings: dict[str, Any] = dict(policy="round_robin", health_interval=0.1, health_timeout=1.0,
                                        metrics_interval=0.1, open_cooldown=0.2, queue_timeout=2.0,
                                        connect_timeout=2.0, request_timeout=10.0, retry_after=1)
        settings.update(overrides)
        rs = RouterServer([(s.name, s.url) for s in stubs], RouterConfig(**settings))
        made.extend([rs, *stubs])
        wait_for(lambda: all(r["state"] == "healthy" and r["continues"] for r in rs.fleet()["replicas"]),
                 "stubs routable")
        return rs, stubs

    yield make
    for x in made:
        x.stop()


def stream_text(rs: RouterServer, **extra: Any) -> tuple[str, set[str], list[dict[str, Any]], str]:
    """Stream a chat answer through the router with the official client: its text, the ids its
    chunks carried, the raw chunks (as dicts) and the replica that started it."""
    client = rs.client()
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=CHAT, stream=True, **extra)
    text, ids, chunks = [], set(), []
    for c in raw.parse():
        ids.add(c.id)
        chunks.append(c.model_dump())
        if c.choices and c.choices[0].delta.content:
            text.append(c.choices[0].delta.content)
    return "".join(text), ids, chunks, raw.headers["x-tripod-replica"]


@pytest.mark.parametrize("failure", ["cut", "error", "split"])
def test_stream_failing_mid_answer_is_continued_exactly(fleet: Any, failure: str) -> None:
    rs, (a, b) = fleet()
    a.fail = (failure, 5)  # round robin: the first request goes to stub-a
    text, ids, chunks, started_on = stream_text(rs)
    assert started_on == "stub-a"
    assert text == full_text()  # no gap, no duplicate (split: the half-sent delta was held back)
    assert ids == {"chatcmpl-stub-a"}  # the continuation keeps the answer's id
    assert all("tripod" not in ch for c in chunks for ch in c["choices"])  # resume points removed
    assert sum(1 for c in chunks for ch in c["choices"] if ch["delta"]["role"]) == 1  # one role chunk
    cont = b.bodies[-1]["tripod_continuation"]
    assert cont["id"] == "chatcmpl-stub-a" and cont["choices"][0]["token_ids"] == list(range(5))
    assert rs.metric("tripod:router_continuations_total", outcome="ok") == 1
    assert rs.metric("tripod:router_stream_failures_total", replica="stub-a") == 1
    wait_for(rs.idle, "the router to be idle")


def test_stall_past_the_stall_timeout_is_continued(fleet: Any) -> None:
    rs, (a, b) = fleet(stall_timeout=0.3)
    a.fail = ("stall", 4)
    text, ids, _, _ = stream_text(rs)
    assert text == full_text() and ids == {"chatcmpl-stub-a"}
    assert b.bodies[-1]["tripod_continuation"]["choices"][0]["token_ids"] == list(range(4))
    wait_for(rs.idle, "the router to be idle")


def test_continuation_failing_too_is_continued_again_within_the_budget(fleet: Any) -> None:
    rs, (a, b, c) = fleet(3, max_retries=2)
    a.fail = ("cut", 3)
    a.shared["fail_continuation"] = ("cut", 7)  # the continuation fails as well, later: continued again
    text, ids, _, _ = stream_text(rs)
    assert text == full_text() and ids == {"chatcmpl-stub-a"}
    conts = sorted(len(x["tripod_continuation"]["choices"][0]["token_ids"]) for s in (b, c) for x in s.bodies)
    assert conts == [3, 7]
    assert rs.metric("tripod:router_continuations_total", outcome="ok") == 2
    wait_for(rs.idle, "the router to be idle")


def test_budget_exhausted_ends_the_stream_with_an_error_event(fleet: Any) -> None:
    rs, (a, _b) = fleet(max_retries=1)
    a.fail = ("cut", 3)
    a.shared["fail_continuation"] = ("cut", 6)
    client = rs.client()
    got: list[str] = []
    with pytest.raises(openai.APIError) as info:
        for ch in client.chat.completions.create(model=MODEL, messages=CHAT, stream=True):
            if ch.choices and ch.choices[0].delta.content:
                got.append(ch.choices[0].delta.content)
    assert "".join(got) == full_text(6)  # what was sent stays exact up to the end
    assert isinstance(info.value.body, dict) and info.value.body["code"] == "replica_failed"
    assert "--max-retries" in info.value.message
    assert rs.metric("tripod:router_continuations_total", outcome="ok") == 1
    assert rs.metric("tripod:router_continuations_total", outcome="exhausted") == 1
    wait_for(rs.idle, "the router to be idle")


def test_no_continuation_with_max_retries_zero(fleet: Any) -> None:
    """--max-retries 0: today's behaviour, and the replica is not asked for resume points."""
    rs, (a, b) = fleet(max_retries=0)
    a.fail = ("cut", 3)
    with pytest.raises(openai.APIError):
        stream_text(rs)
    assert "tripod_failover" not in a.bodies[-1] and not b.bodies
    wait_for(rs.idle, "the router to be idle")


def test_whole_answer_retried_as_a_continuation(fleet: Any) -> None:
    rs, (a, b) = fleet()
    a.fail = ("cut", 5)
    r = rs.post(max_tokens=N_TOKENS, logprobs=True)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/json"
    assert r.json()["served_by"] == "stub-b" and r.json()["id"] == "chatcmpl-stub-a"
    assert a.bodies[-1]["tripod_failover"] is True and not a.bodies[-1].get("stream")
    cont = b.bodies[-1]["tripod_continuation"]["choices"][0]
    assert cont["token_ids"] == list(range(5)) and cont["logprobs"] == [[t, -0.5, []] for t in range(5)]
    assert rs.metric("tripod:router_continuations_total", outcome="ok") == 1
    # Undisturbed: the result event's bytes are the answer.
    r = rs.post(max_tokens=N_TOKENS)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == full_text()
    wait_for(rs.idle, "the router to be idle")


def test_continuation_refused_then_another_replica_takes_over(fleet: Any) -> None:
    rs, (a, _b, _c) = fleet(3, refusals=1)  # the first continuation attempt is answered 503
    a.fail = ("cut", 2)
    text, ids, _, _ = stream_text(rs)
    assert ids == {"chatcmpl-stub-a"}
    assert text == full_text()
    assert rs.metric("tripod:router_continuations_total", outcome="failed") == 1
    assert rs.metric("tripod:router_continuations_total", outcome="ok") == 1
    wait_for(rs.idle, "the router to be idle")


def test_a_client_naming_tripods_private_fields_is_passed_through(fleet: Any) -> None:
    rs, (a, _b) = fleet()
    with httpx.stream("POST", rs.url + "/v1/chat/completions", timeout=10,
                      json={"model": MODEL, "messages": CHAT, "stream": True, "tripod_failover": True}) as r:
        body = b"".join(r.iter_raw())
    assert b'"tripod":' in body  # the client asked for the resume points itself: it gets them
    assert a.bodies[-1]["tripod_failover"] is True
