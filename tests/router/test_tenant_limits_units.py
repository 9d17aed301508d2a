"""The router's side of fleet-wide token limits without processes: a stream's output count read
as it passes (Anthropic's ``message_delta`` usage, OpenAI's ``include_usage`` chunk, a failover
answer's token ids), settled into the tenant record when the stream closes; unknown stays unknown
(the reservation is kept); and the replica's count message, validated."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest

from tripod.asgi import ClosingStream
from tripod.router.failover import AnswerProgress, ChoiceProgress
from tripod.router.tenant_limits import OutputCount, settle_whole
from tripod.tenants import RequestRecord, Tenant, TokenCounts
from tripod.tenants.registry import Identity


def _rec() -> RequestRecord:
    rec = RequestRecord(Identity(Tenant("acme", output_tokens_per_minute=100), "k"), "/v1/messages")
    rec.output_known = False
    return rec


def _drain(chunks: list[bytes], answer: AnswerProgress | None = None) -> RequestRecord:
    async def body() -> AsyncIterator[bytes]:
        for c in chunks:
            yield c

    closed: list[bool] = []
    resp = ClosingStream(body(), on_close=lambda: closed.append(True))
    if answer is not None:
        resp.answer = answer  # type: ignore[attr-defined]
    rec = _rec()
    OutputCount(rec, resp)

    async def run() -> None:
        async for _ in resp.body_iterator:
            pass

    asyncio.run(run())
    resp.on_close()
    assert closed == [True]  # the stream's own close still runs
    return rec


def _sse(obj: dict[str, object], event: str | None = None) -> bytes:
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + json.dumps(obj).encode() + b"\n\n"


def test_anthropic_stream_counts_its_message_delta_usage() -> None:
    start = _sse({"type": "message_start", "message": {"usage": {"input_tokens": 9, "output_tokens": 1}}},
                 "message_start")
    delta = _sse({"type": "message_delta", "usage": {"output_tokens": 7}}, "message_delta")
    # Split across chunk boundaries the way a relay may pass them.
    rec = _drain([start[:20], start[20:], delta[:11], delta[11:], _sse({"type": "message_stop"}, "message_stop")])
    assert (rec.output_tokens, rec.output_known) == (7, True)


def test_openai_stream_with_include_usage_and_without() -> None:
    chunk = _sse({"choices": [{"delta": {"content": "hi"}}]})
    rec = _drain([chunk, _sse({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3}}),
                  b"data: [DONE]\n\n"])
    assert (rec.output_tokens, rec.output_known) == (3, True)
    rec = _drain([chunk, chunk, b"data: [DONE]\n\n"])
    assert rec.output_known is False  # no count seen: the whole reservation is kept


def test_failover_stream_counts_the_token_ids_the_client_was_sent() -> None:
    answer = AnswerProgress({"stream": True}, True)
    answer.choices = {0: ChoiceProgress(token_ids=[1, 2, 3]), 1: ChoiceProgress(token_ids=[4, 5])}
    rec = _drain([_sse({"choices": [], "usage": {"completion_tokens": 99}})], answer)
    assert (rec.output_tokens, rec.output_known) == (5, True)


def test_an_error_answer_is_refunded_whole() -> None:
    from starlette.responses import Response

    rec = _rec()
    settle_whole(rec, Response(b"{}", status_code=503))
    assert (rec.output_tokens, rec.output_known) == (0, True)


def test_count_message_round_trip_and_validation() -> None:
    c = TokenCounts(12, 32, 44)
    assert TokenCounts.from_json(json.loads(json.dumps(c.as_json()))) == c
    for bad in ({"object": "chat.completion"}, {**c.as_json(), "input_tokens": -1},
                {**c.as_json(), "output_tokens": True}, [1, 2]):
        with pytest.raises(ValueError):
            TokenCounts.from_json(bad)
