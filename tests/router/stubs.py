"""Stub OpenAI-ish replicas and a router, each a uvicorn server in a background thread on
127.0.0.1, for the router's tests over real HTTP (``conftest.py`` makes them fixtures).

Nothing is mocked: the stubs are small Starlette apps whose behaviour each test sets (answer, fail
with a status, cut a stream, hold a request, ...) and which count what they were sent; the router is
``build_router_app`` with a lifespan that starts and stops its ``Router``. State is waited for by
polling with deadlines, never by fixed sleeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import httpx
import openai
import uvicorn
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tripod.config import RouterConfig
from tripod.router.app import build_router_app
from tripod.router.router import Router

T = TypeVar("T")
MODEL = "stub-model"
CHAT = [{"role": "user", "content": "Say hi."}]
STATUS_MODES = {"400": 400, "429": 429, "500": 500, "503": 503, "529": 529}


# ---------------------------------------------------------------------------------------- helpers
def wait_for(pred: Callable[[], T], what: str, timeout: float = 10.0) -> T:
    """Poll ``pred`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)  # polling for a state, with a deadline


async def wait_event(event: threading.Event, timeout: float) -> bool:
    """Wait for a threading.Event from a stub's event loop, cancellably (no thread left blocked)."""
    deadline = time.monotonic() + timeout
    while not event.is_set():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.005)
    return True


class ServerThread:
    """An ASGI app served by uvicorn in a daemon thread on a free 127.0.0.1 port (the socket is bound
    here and handed to uvicorn, so no other process can take the port in between)."""

    def __init__(self, app: Any, graceful: float = 2.0, lifespan: str = "on", start_timeout: float = 10.0) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, http="h11", loop="asyncio", log_config=None, log_level="warning",
                                access_log=False, lifespan=lifespan, timeout_graceful_shutdown=graceful)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        wait_for(lambda: self.server.started or not self.thread.is_alive(), "uvicorn to start", start_timeout)
        if not self.server.started:
            raise RuntimeError("uvicorn did not start (see the log)")

    def stop(self, force: bool = False) -> None:
        """Stop serving; ``force`` skips waiting for open connections (and the lifespan shutdown)."""
        self.server.should_exit = True
        self.server.force_exit = force
        self.thread.join(15)
        assert not self.thread.is_alive(), "uvicorn did not stop"
        self.sock.close()


def closed_port_url() -> tuple[str, socket.socket]:
    """A URL whose port refuses connections: bound (so nobody else gets it) but not listening."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    return f"http://127.0.0.1:{s.getsockname()[1]}", s


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def chunk_event(name: str, i: int) -> bytes:
    return sse({"id": f"chatcmpl-{name}", "object": "chat.completion.chunk", "created": 1, "model": MODEL,
                "choices": [{"index": 0, "delta": {"content": f"{name}#{i} "}, "finish_reason": None}]})


def prompt_tokens(body: dict[str, Any]) -> int:
    """A stub's token count of a prompt: about 4 characters a token, like the router's first guess."""
    text = "".join(str(m.get("content", "")) for m in body.get("messages") or []) or str(body.get("prompt", ""))
    return max(1, len(text) // 4)


def ok_body(name: str, path: str, n_prompt: int = 5) -> bytes:
    """A stub's exact non-stream answer (non-ASCII on purpose: it must come back byte for byte)."""
    usage = {"prompt_tokens": n_prompt, "completion_tokens": 3, "total_tokens": n_prompt + 3}
    if path.endswith("chat/completions"):
        body = {"id": f"chatcmpl-{name}", "object": "chat.completion", "created": 1, "model": MODEL,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": f"héllo from {name} ✓"},
                             "finish_reason": "stop"}], "usage": usage}
    else:
        body = {"id": f"cmpl-{name}", "object": "text_completion", "created": 1, "model": MODEL,
                "choices": [{"index": 0, "text": f"héllo from {name} ✓", "finish_reason": "stop",
                             "logprobs": None}], "usage": usage}
    return json.dumps(body, ensure_ascii=False, indent=1).encode()


def anthropic_body(name: str, n_prompt: int = 5) -> bytes:
    body = {"id": f"msg_{name}", "type": "message", "role": "assistant", "model": MODEL,
            "content": [{"type": "text", "text": f"héllo from {name} ✓"}], "stop_reason": "end_turn",
            "stop_sequence": None, "usage": {"input_tokens": n_prompt, "output_tokens": 3}}
    return json.dumps(body, ensure_ascii=False).encode()


def anthropic_event(name: str, data: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()


def anthropic_stream_bytes(name: str, cut: bool = False) -> list[bytes]:
    start = json.loads(anthropic_body(name))
    start.update(content=[], stop_reason=None)
    out = [anthropic_event("message_start", {"type": "message_start", "message": start}),
           anthropic_event("content_block_start", {"type": "content_block_start", "index": 0,
                                                   "content_block": {"type": "text", "text": ""}})]
    out += [anthropic_event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                    "delta": {"type": "text_delta", "text": f"{name}#{i} "}})
            for i in range(3)]
    if cut:
        return out[:3]
    return [*out, anthropic_event("content_block_stop", {"type": "content_block_stop", "index": 0}),
            anthropic_event("message_delta", {"type": "message_delta", "delta": {
                "stop_reason": "end_turn", "stop_sequence": None}, "usage": {"output_tokens": 3}}),
            anthropic_event("message_stop", {"type": "message_stop"})]


def error_body(name: str, status: int) -> bytes:
    return json.dumps({"error": {"message": f"{name} answers {status} on purpose", "type": "stub_error",
                                 "param": "max_tokens", "code": f"stub_{status}"}}).encode()


class Stub:
    """An OpenAI-ish upstream. ``mode`` (read when a request arrives):

    - ``ok``: answer (a stream: 3 chunks and ``[DONE]``);
    - ``400`` / ``429`` / ``500`` / ``503``: answer that status with an error body;
    - ``gate``: (stream) one chunk, then wait for ``gate`` before the rest;
    - ``cut_midstream``: (stream) two chunks, then the connection is dropped (chunked body unfinished);
    - ``cut_before_first``: (stream) the status line and headers, then the connection is dropped;
    - ``hold``: wait for ``release`` before answering;
    - ``endless``: (stream) a chunk every 20 ms for 10 s.

    ``health`` is what GET /health answers. ``posts`` counts POSTs; ``streams`` records how each
    stream ended: done, cut (on purpose) or cancelled (the client went away)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.mode = "ok"
        self.health = 200
        self.posts = 0
        self.active = 0  # requests inside a handler right now (hold mode)
        self.bodies: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.streams: list[str] = []
        self.gate = threading.Event()
        self.release = threading.Event()
        app = Starlette(routes=[
            Route("/health", self._health, methods=["GET"]),
            Route("/metrics", self._metrics, methods=["GET"]),
            Route("/v1/chat/completions", self._post, methods=["POST"]),
            Route("/v1/completions", self._post, methods=["POST"]),
            Route("/v1/messages", self._post, methods=["POST"]),
            Route("/v1/messages/count_tokens", self._post, methods=["POST"]),
            Route("/v1/responses", self._responses, methods=["POST"]),
        ])
        self.server = ServerThread(app, lifespan="off")
        self.url = self.server.url

    async def _health(self, _: Request) -> Response:
        return JSONResponse({"status": "ok" if self.health == 200 else "draining"}, status_code=self.health)

    async def _metrics(self, _: Request) -> Response:
        page = (f'tripod:num_requests_running{{model_name="{MODEL}"}} {self.active}\n'
                f'tripod:num_requests_waiting{{model_name="{MODEL}"}} 0\n')
        return Response(page, media_type="text/plain; version=0.0.4")

    async def _post(self, request: Request) -> Response:
        self.posts += 1
        body = await request.json()
        self.bodies.append(body)
        self.headers.append(dict(request.headers))
        mode = self.mode
        path = request.url.path
        if mode in STATUS_MODES:
            status = STATUS_MODES[mode]
            headers = {"Retry-After": "7"} if status == 429 else None
            return Response(error_body(self.name, status), status_code=status, media_type="application/json",
                            headers=headers)
        if mode == "hold":
            self.active += 1
            try:
                await wait_event(self.release, 20)
            finally:
                self.active -= 1
        if path == "/v1/messages/count_tokens":
            return JSONResponse({"input_tokens": prompt_tokens(body)})
        if path == "/v1/messages":
            if not body.get("stream"):
                return Response(anthropic_body(self.name, prompt_tokens(body)), media_type="application/json")
            return StreamingResponse(self._anthropic_stream(mode), media_type="text/event-stream")
        if not body.get("stream"):
            return Response(ok_body(self.name, request.url.path, prompt_tokens(body)), media_type="application/json",
                            headers={"x-request-id": f"req-{self.name}", "x-stub-only": "1"})
        return StreamingResponse(self._stream(mode), media_type="text/event-stream")

    async def _responses(self, request: Request) -> Response:
        """A Responses API answer: ``resp_<name>_<n>``, whole or as an event stream whose first
        event (``response.created``) arrives in two chunks."""
        self.posts += 1
        body = await request.json()
        self.bodies.append(body)
        rid = f"resp_{self.name.replace('-', '_')}_{self.posts}"
        obj = {"id": rid, "object": "response", "status": "completed", "model": MODEL, "output": [],
               "previous_response_id": body.get("previous_response_id")}
        if not body.get("stream"):
            return JSONResponse(obj)

        async def events() -> AsyncIterator[bytes]:
            created = sse({"type": "response.created", "sequence_number": 0, "response": {**obj, "status": "in_progress"}})
            yield created[:40]
            yield created[40:]
            yield sse({"type": "response.completed", "sequence_number": 1, "response": obj})

        return StreamingResponse(events(), media_type="text/event-stream")

    async def _anthropic_stream(self, mode: str) -> AsyncIterator[bytes]:
        for piece in anthropic_stream_bytes(self.name, cut=mode == "cut_midstream"):
            yield piece
        if mode == "cut_midstream":
            self.streams.append("cut")
            raise RuntimeError("stub drops the connection mid-stream (on purpose)")
        self.streams.append("done")

    async def _stream(self, mode: str) -> AsyncIterator[bytes]:
        outcome = "closed"
        try:
            if mode == "cut_before_first":
                outcome = "cut"
                raise RuntimeError("stub drops the connection before its first byte (on purpose)")
            if mode == "gate":
                yield chunk_event(self.name, 0)
                if not await wait_event(self.gate, 15):
                    outcome = "gate_timeout"
                    raise RuntimeError("the gate was never opened")
                yield chunk_event(self.name, 1)
            elif mode == "cut_midstream":
                yield chunk_event(self.name, 0)
                yield chunk_event(self.name, 1)
                outcome = "cut"
                raise RuntimeError("stub drops the connection mid-stream (on purpose)")
            elif mode == "endless":
                for i in range(500):
                    yield chunk_event(self.name, i)
                    await asyncio.sleep(0.02)
            else:
                for i in range(3):
                    yield chunk_event(self.name, i)
            yield b"data: [DONE]\n\n"
            outcome = "done"
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        finally:
            self.streams.append(outcome)

    def stop(self) -> None:
        if self.server.thread.is_alive():
            self.server.stop(force=True)


def ok_stream_bytes(name: str) -> bytes:
    return b"".join(chunk_event(name, i) for i in range(3)) + b"data: [DONE]\n\n"


class RouterServer:
    """A ``Router`` over the given replicas, served by ``build_router_app`` (its lifespan starts and
    stops the router)."""

    def __init__(self, replicas: list[tuple[str, str]], config: RouterConfig) -> None:
        self.router = router = Router(config, rng=random.Random(20240611))  # reproducible tie-breaks
        for name, url in replicas:
            router.add_replica(name, url)

        @contextlib.asynccontextmanager
        async def lifespan(_: Any) -> AsyncIterator[None]:
            await router.start()
            try:
                yield
            finally:
                await router.stop()

        self.server = ServerThread(build_router_app(router, lifespan), graceful=3.0)
        self.url = self.server.url
        self.http = httpx.Client(base_url=self.url, timeout=10)

    def client(self, timeout: float = 10.0) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=timeout)

    def fleet(self) -> dict[str, Any]:
        r = self.http.get("/fleet")
        assert r.status_code == 200
        return dict(r.json())

    def replica(self, name: str) -> dict[str, Any]:
        return next(r for r in self.fleet()["replicas"] if r["name"] == name)

    def states(self) -> dict[str, str]:
        return {r["name"]: r["state"] for r in self.fleet()["replicas"]}

    def idle(self) -> bool:
        f = self.fleet()
        return f["pending"] == 0 and f["queue_depth"] == 0 and all(r["inflight"] == 0 for r in f["replicas"])

    def metric(self, name: str, **labels: str) -> float:
        """The sum of the samples of ``name`` whose labels include ``labels`` (0 when there are none)."""
        r = self.http.get("/metrics")
        assert r.status_code == 200
        total = 0.0
        for family in text_string_to_metric_families(r.text):
            for s in family.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    total += s.value
        return total

    def post(self, path: str = "/v1/chat/completions", **body: Any) -> httpx.Response:
        return self.http.post(path, json={"model": MODEL, "messages": CHAT, **body})

    def stop(self) -> None:
        self.http.close()
        self.server.stop()


def assert_openai_error(r: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json"), r.headers
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] in ("invalid_request_error", "server_error"), err
    if code is not None:
        assert err["code"] == code, err
    return dict(err)
