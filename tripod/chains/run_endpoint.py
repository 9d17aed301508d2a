"""``POST /run`` over HTTP, the same for a chainlet's replica and for the server of a chain.

The arguments are validated first (400 naming the field). A unary call runs as a task that is
cancelled if the client disconnects (499). A streaming call runs its generator in one producer
task from start to end (so the chainlet's own context managers never cross tasks); the answer's
headers go out with the first item, so a failure before it is an error status the caller may
retry, and a failure after it is an ``event: error``. The client leaving cancels the producer,
which cancels everything the chainlet was waiting on: its dependencies' calls and LLM requests.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from tripod.asgi import BodyTooLarge, ClientGone, ClosingStream, read_body, until_disconnect
from tripod.chains.errors import ChainletError
from tripod.chains.metrics import ChainMetrics
from tripod.chains.signature import Signature

log = logging.getLogger("tripod.chains")

MAX_BODY_BYTES = 16 * 2**20
_QUEUE = 16  # items a producer may run ahead of a slow client


def error_response(e: ChainletError) -> Response:
    return Response(e.to_json(), status_code=e.status, media_type="application/json")


def _sse(data: Any, event: str | None = None) -> bytes:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data, separators=(',', ':'), default=str)}\n\n".encode()


async def _read_json(request: Request, name: str) -> Any:
    try:
        raw = await read_body(request, MAX_BODY_BYTES)
    except BodyTooLarge:
        raise ChainletError(name, f"the request body is larger than {MAX_BODY_BYTES} bytes",
                            code="request_too_large", status=413) from None
    if not raw.strip():
        return {}
    try:
        return json.loads(raw)
    except ValueError as e:
        raise ChainletError(name, f"the request body is not valid JSON ({e}); send the arguments as a JSON "
                            "object", code="invalid_json", status=400) from None


def _unexpected(name: str, e: Exception) -> ChainletError:
    log.exception("%s: unexpected error", name)
    return ChainletError(name, f"{type(e).__name__}: {e}", code="internal_error", status=500, retryable=True)


async def _unary(request: Request, name: str, work: Awaitable[Any]) -> Response:
    """A unary call's answer: its JSON, its error, or 499 when the client left first (the call,
    and everything it waits on, is then cancelled)."""
    try:
        data = await until_disconnect(request, work)
    except ClientGone:
        return Response(status_code=499)
    except ChainletError as e:
        return error_response(e)
    except Exception as e:
        return error_response(_unexpected(name, e))
    return Response(json.dumps(data, separators=(",", ":"), default=str), media_type="application/json")


async def _produce(name: str, stream: Callable[[dict[str, Any]], AsyncIterator[Any]], args: dict[str, Any],
                   queue: asyncio.Queue[tuple[str, Any]]) -> None:
    """Run a streaming call from start to end in one task (so the chainlet's own context managers
    never cross tasks): its items, then its end or its error."""
    try:
        async for item in stream(args):
            await queue.put(("item", item))
        await queue.put(("end", None))
    except ChainletError as e:
        await queue.put(("error", e))
    except Exception as e:
        await queue.put(("error", _unexpected(name, e)))


async def _events(kind: str, value: Any, queue: asyncio.Queue[tuple[str, Any]]) -> AsyncIterator[bytes]:
    """The stream's SSE events from its first queued entry on: items, then ``end`` or ``error``."""
    sent = 0
    while True:
        if kind == "item":
            sent += 1
            yield _sse(value)
        elif kind == "end":
            yield _sse({"items": sent}, "end")
            return
        else:
            yield _sse(value.body(), "error")
            return
        kind, value = await queue.get()


async def _streamed(request: Request, producer: asyncio.Task[None],
                    queue: asyncio.Queue[tuple[str, Any]]) -> Response:
    """A streaming call's answer once its first entry is queued: an error status when it failed
    before its first item, 499 when the client left first, else the event stream."""
    try:
        kind, value = await until_disconnect(request, queue.get())
    except ClientGone:
        producer.cancel()
        return Response(status_code=499)
    if kind == "error":
        return error_response(value)

    def stop() -> None:
        producer.cancel()  # the client left (or the stream ended: then a no-op)

    return ClosingStream(_events(kind, value, queue), on_close=stop, media_type="text/event-stream",
                         headers={"cache-control": "no-cache"})


def run_endpoint(sig: Signature, metrics: ChainMetrics,
                 call: Callable[[dict[str, Any]], Awaitable[Any]],
                 stream: Callable[[dict[str, Any]], AsyncIterator[Any]],
                 parse: Callable[[Any], dict[str, Any]]) -> Callable[[Request], Awaitable[Response]]:
    """The ``/run`` handler: ``parse`` validates the body into arguments; ``call`` answers a unary
    call with JSON-shaped data, ``stream`` iterates a streaming one."""
    name = sig.name
    producers: set[asyncio.Task[None]] = set()  # NOTE: the loop keeps only weak references to tasks

    async def handler(request: Request) -> Response:
        try:
            payload = await _read_json(request, name)
            args = parse(payload)
        except ChainletError as e:
            return error_response(e)
        if not sig.streaming:
            return await _unary(request, name, call(args))
        queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue(_QUEUE)
        producer = asyncio.ensure_future(_produce(name, stream, args, queue))
        producers.add(producer)
        producer.add_done_callback(producers.discard)
        return await _streamed(request, producer, queue)

    return handler
