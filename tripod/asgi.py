"""ASGI and uvicorn pieces shared by the server, the router and chains (which never import each
other): reading a bounded request body, answering unless the client left, a stream that always
runs its clean-up, and uvicorn with draining. Torch-free."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from types import FrameType
from typing import TypeVar

import uvicorn
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

T = TypeVar("T")


def header(scope: Scope, name: bytes) -> str | None:
    """The value of the request header ``name`` (lower case, as ASGI gives names), or None."""
    for k, v in scope.get("headers") or ():
        if k == name:
            return str(v.decode("latin-1"))
    return None


class BodyTooLarge(Exception):
    """A request body over its limit; each app answers it with a 413 in its own error shape."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"the request body is larger than {limit} bytes")
        self.limit = limit


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready."""


async def read_body(request: Request, limit: int) -> bytes:
    """The whole request body, or ``BodyTooLarge`` as soon as it is known to pass ``limit`` bytes:
    from its declared Content-Length before a byte is read, else while reading, so an oversized
    upload is never held in memory whole."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise BodyTooLarge(limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(limit)
        chunks.append(chunk)
    return b"".join(chunks)


async def _disconnected(request: Request) -> None:
    # NOTE: the body was read already, so the next ASGI message can only be the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, aw: Awaitable[T]) -> T:
    """Await ``aw`` unless the client goes away first: then ``aw`` is cancelled (its clean-up has
    run when this returns: an upstream request closed, a replica's accounting released) and
    ``ClientGone`` is raised. Only after the body is read. Cancelling the caller cancels ``aw``."""
    work = asyncio.ensure_future(aw)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        work.cancel()
        watch.cancel()
        raise
    if work.done():
        watch.cancel()
        return work.result()
    work.cancel()
    await asyncio.gather(work, return_exceptions=True)
    raise ClientGone()


class ClosingStream(StreamingResponse):
    """A streaming response whose ``on_close`` runs exactly once however the stream ends: finished,
    client gone, or cancelled by a shutdown (the server aborts the request in its engine; the
    router releases the replica's accounting and closes the upstream connection)."""

    def __init__(self, body: AsyncIterator[bytes], on_close: Callable[[], None], media_type: str | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(body, media_type=media_type, headers=headers)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


class DrainingServer(uvicorn.Server):
    """uvicorn with draining: every SIGTERM/SIGINT first calls ``on_signal`` (the app marks itself
    draining: new requests get 503 + Retry-After), while uvicorn closes the port and waits for the
    answers in flight up to its graceful-shutdown timeout."""

    def __init__(self, config: uvicorn.Config, on_signal: Callable[[signal.Signals], None]) -> None:
        super().__init__(config)
        self.on_signal = on_signal

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.on_signal(signal.Signals(sig))
        super().handle_exit(sig, frame)
        # NOTE: uvicorn re-raises captured signals after shutdown (exit 143 for SIGTERM); a clean
        # drain is a clean exit, so the exit code is ours to set.
        self._captured_signals.clear()
