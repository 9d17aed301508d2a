"""tripod.asgi's shared request helpers: a bounded body (by its declared length, or while
reading) and waiting unless the client leaves (the work cancelled and its clean-up run)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from starlette.requests import Request

from tripod.asgi import BodyTooLarge, ClientGone, read_body, until_disconnect


def _request(chunks: list[bytes], length: int | None = None, then_disconnect: bool = False) -> Request:
    messages: list[dict[str, Any]] = [
        {"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)
    ]
    headers = [(b"content-length", str(length).encode())] if length is not None else []

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop(0)
        if then_disconnect:
            return {"type": "http.disconnect"}
        await asyncio.Event().wait()  # the client stays
        raise AssertionError("unreachable")

    scope = {"type": "http", "method": "POST", "path": "/", "headers": headers}
    return Request(scope, receive)


def test_read_body_joins_the_chunks_up_to_the_limit() -> None:
    assert asyncio.run(read_body(_request([b"ab", b"cd"]), 4)) == b"abcd"


def test_read_body_refuses_a_declared_length_past_the_limit_before_reading() -> None:
    req = _request([b"x"], length=5)
    with pytest.raises(BodyTooLarge) as e:
        asyncio.run(read_body(req, 4))
    assert e.value.limit == 4


def test_read_body_refuses_an_undeclared_body_once_it_passes_the_limit() -> None:
    with pytest.raises(BodyTooLarge):
        asyncio.run(read_body(_request([b"abc", b"de", b"never read"]), 4))


def test_until_disconnect_returns_the_answer_while_the_client_stays() -> None:
    async def run() -> int:
        req = _request([b""])
        await read_body(req, 10)
        return await until_disconnect(req, asyncio.sleep(0.01, result=7))
    assert asyncio.run(run()) == 7


def test_until_disconnect_cancels_the_work_when_the_client_leaves() -> None:
    cleaned: list[bool] = []

    async def work() -> None:
        try:
            await asyncio.sleep(30)
        finally:
            cleaned.append(True)

    async def run() -> None:
        req = _request([b""], then_disconnect=True)
        await read_body(req, 10)
        with pytest.raises(ClientGone):
            await until_disconnect(req, work())
        assert cleaned == [True], "the work's clean-up has run when ClientGone is raised"
    asyncio.run(run())
