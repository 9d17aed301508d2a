"""The decode replica's hand-over gate (``server/api/pd.py``): a request carrying the router's hand-over
id is admitted only once that id's KV streams have ended, so a fallback after a prefill replica died
mid-transfer finds every block the cut stream verified; other requests are never held."""

from __future__ import annotations

import asyncio
from typing import Any

from tripod.protocol import pd
from tripod.server.api.pd import HandOverGate, Receiving


def _scope(path: str, transfer: str | None) -> dict[str, Any]:
    headers = [(b"content-type", b"application/json")]
    if transfer is not None:
        headers.append((pd.TRANSFER_HEADER.encode(), transfer.encode()))
    return {"type": "http", "path": path, "headers": headers}


async def _nothing() -> dict[str, Any]:
    return {"type": "http.request", "body": b"", "more_body": False}


async def _drop(_: Any) -> None:
    return None


def test_a_request_waits_for_its_hand_overs_streams_and_no_other() -> None:
    async def main() -> list[str]:
        events: list[str] = []
        stream_may_end = asyncio.Event()

        async def app(scope: Any, receive: Any, send: Any) -> None:
            name = f"{scope['path']}:{dict(scope['headers']).get(pd.TRANSFER_HEADER.encode(), b'-').decode()}"
            events.append(f"enter {name}")
            if scope["path"] == pd.KV_PATH:
                await stream_may_end.wait()  # still publishing the blocks it received
            events.append(f"leave {name}")

        gate = HandOverGate(app, Receiving())
        kv = asyncio.create_task(gate(_scope(pd.KV_PATH, "t1"), _nothing, _drop))
        await asyncio.sleep(0)  # the stream is being received
        chat = asyncio.create_task(gate(_scope("/v1/chat/completions", "t1"), _nothing, _drop))
        other = asyncio.create_task(gate(_scope("/v1/chat/completions", "t2"), _nothing, _drop))
        plain = asyncio.create_task(gate(_scope("/v1/completions", None), _nothing, _drop))
        await asyncio.wait_for(asyncio.gather(other, plain), 5)
        assert not chat.done(), "the request ran while its hand-over's stream was still open"
        stream_may_end.set()
        await asyncio.wait_for(asyncio.gather(kv, chat), 5)
        return events

    events = asyncio.run(main())
    assert events.index("leave /v1/pd/kv:t1") < events.index("enter /v1/chat/completions:t1"), events
    assert "enter /v1/chat/completions:t2" in events and "enter /v1/completions:-" in events


def test_a_stream_that_never_ends_holds_the_request_only_until_the_deadline() -> None:
    async def main() -> tuple[bool, bool]:
        receiving = Receiving()
        with receiving.stream("t"):
            held = await receiving.settled("t", timeout=0.05)
        return held, await receiving.settled("t", timeout=0.05)

    timed_out, after = asyncio.run(main())
    assert timed_out is False and after is True
