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

from tripod.asgi import ClosingStream
from tripod.chains.core import Signature
from tripod.chains.errors import ChainletError
from tripod.chains.metrics import ChainMetrics

log = logging.getLogger("tripod.chains")

MAX_BODY_BYTES = 16 * 2**20
_QUEUE = 16  # items a producer may run ahead of a slow client


def error_response(e: ChainletError) -> Response:
    return Response(e.to_json(), status_code=e.status, media_type="application/json")


def _sse(data: Any, event: str | None = None) -> bytes:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data, separators=(',', ':'), default=str)}\n\n".encode()


async def _read_json(request: Request, name: str) -> Any:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise ChainletError(name, f"the request body is larger than {MAX_BODY_BYTES} bytes",
                                code="request_too_large", status=413)
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.strip():
        return {}
    try:
        return json.loads(raw)
    except ValueError as e:
        raise ChainletError(name, f"the request body is not valid JSON ({e}); send the arguments as a JSON "
                            "object", code="invalid_json", status=400) from None


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (the body is already read: only a disconnect can come)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _unexpected(name: str, e: Exception) -> ChainletError:
    log.exception("%s: unexpected error", name)
    return ChainletError(name, f"{type(e).__name__}: {e}", code="internal_error", status=500, retryable=True)


def run_endpoint(sig: Signature, metrics: ChainMetrics,
                 call: Callable[[dict[str, Any]], Awaitable[Any]],
                 stream: Callable[[dict[str, Any]], AsyncIterator[Any]],
                 parse: Callable[[Any], dict[str, Any]]) -> Callable[[Request], Awaitable[Response]]:
    """The ``/run`` handler: ``parse`` validates the body into arguments; ``call`` answers a unary
    call with JSON-shaped data, ``stream`` iterates a streaming one."""
    name = sig.name
    tasks: set[asyncio.Task[Any]] = set()  # NOTE: the loop keeps only weak references to tasks

    def keep(t: asyncio.Task[Any]) -> asyncio.Task[Any]:
        tasks.add(t)
        t.add_done_callback(tasks.discard)
        return t

    async def race(request: Request, work: asyncio.Future[Any]) -> bool:
        """Wait for ``work``; False when the client left first (``work`` is then cancelled)."""
        gone = asyncio.ensure_future(_disconnected(request))
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        if work.done():
            gone.cancel()
            return True
        work.cancel()
        await asyncio.gather(work, return_exceptions=True)
        return False

    async def unary(request: Request, args: dict[str, Any]) -> Response:
        task = keep(asyncio.ensure_future(call(args)))
        if not await race(request, task):
            return Response(status_code=499)
        try:
            data = task.result()
        except ChainletError as e:
            return error_response(e)
        except Exception as e:
            return error_response(_unexpected(name, e))
        return Response(json.dumps(data, separators=(",", ":"), default=str), media_type="application/json")

    async def streamed(request: Request, args: dict[str, Any]) -> Response:
        queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue(_QUEUE)

        async def produce() -> None:
            try:
                async for item in stream(args):
                    await queue.put(("item", item))
                await queue.put(("end", None))
            except ChainletError as e:
                await queue.put(("error", e))
            except Exception as e:
                await queue.put(("error", _unexpected(name, e)))

        producer = keep(asyncio.ensure_future(produce()))
        first = asyncio.ensure_future(queue.get())
        if not await race(request, first):
            producer.cancel()
            return Response(status_code=499)
        kind, value = first.result()
        if kind == "error":
            return error_response(value)

        async def body() -> AsyncIterator[bytes]:
            k, v, sent = kind, value, 0
            while True:
                if k == "item":
                    sent += 1
                    yield _sse(v)
                elif k == "end":
                    yield _sse({"items": sent}, "end")
                    return
                else:
                    yield _sse(v.body(), "error")
                    return
                k, v = await queue.get()

        def stop() -> None:
            producer.cancel()  # the client left (or the stream ended: then a no-op)

        return ClosingStream(body(), on_close=stop, media_type="text/event-stream",
                             headers={"cache-control": "no-cache"})

    async def handler(request: Request) -> Response:
        try:
            payload = await _read_json(request, name)
            args = parse(payload)
        except ChainletError as e:
            return error_response(e)
        return await (streamed(request, args) if sig.streaming else unary(request, args))

    return handler
