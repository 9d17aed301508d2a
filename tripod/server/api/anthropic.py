"""The Anthropic surface: ``POST /v1/messages`` (text, tool use, streaming with Anthropic's event
sequence) and ``POST /v1/messages/count_tokens``.

Errors on these routes take Anthropic's shape (``server/errors.py`` picks it by path); a full server answers
529 ``overloaded_error``. ``usage`` follows Anthropic's accounting: ``input_tokens`` are the prompt
tokens not read from the prefix cache, ``cache_read_input_tokens`` those that were (their sum is
what ``count_tokens`` says).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tripod.asgi import ClosingStream, until_disconnect
from tripod.server.answer.generation import Delta, Usage, collect, new_id
from tripod.server.answer.reasoning import Split, Thinking
from tripod.server.answer.tools import (
    ArgsPiece,
    CallEnd,
    CallStart,
    TextPiece,
    ToolCallParser,
    ToolCallStream,
    ToolEvent,
)
from tripod.server.api.admission import Started, start_generation
from tripod.server.api.anthropic_requests import (
    TEMPERATURE_MAX,
    CountTokensRequest,
    MessagesRequest,
    conversation,
    output_format,
    thinking_budget,
)
from tripod.server.api.body import parse, read_body
from tripod.server.api.sampling import build_sampling, stop_strings
from tripod.server.engine_client import EnginePart
from tripod.server.errors import APIError
from tripod.server.media.prompt import render_prompt
from tripod.server.state import ServerState, adapter_of, check_model

OVERLOADED = 529  # Anthropic's status for a server at capacity


def add_anthropic_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        return await _messages(state, request)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> JSONResponse:
        req: CountTokensRequest = parse(CountTokensRequest, await read_body(request, state.config.max_body_bytes))
        check_model(state, req.model, request)
        msgs, tools, _, cont = conversation(req, state.chat.parallel_default)
        prompt = await render_prompt(state, msgs, tools, continue_final=cont)  # (image tokens count)
        return JSONResponse({"input_tokens": len(prompt.ids)})


def _usage(u: Usage) -> dict[str, int]:
    return {"input_tokens": u.prompt_tokens - u.cached_tokens, "output_tokens": u.completion_tokens,
            "cache_read_input_tokens": u.cached_tokens, "cache_creation_input_tokens": 0}


class Blocks:
    """Tool-parser events → Anthropic content blocks, and the stream events that build them.
    Streamed and whole answers both go through it, so they always agree. A text block opens only
    once it has more than whitespace (Anthropic refuses blank text blocks sent back to it). A
    model's thinking (``thinking``) becomes ``thinking`` blocks, with an empty ``signature``
    (nothing to verify: tripod ignores thinking blocks sent back)."""

    def __init__(self) -> None:
        self.content: list[dict[str, Any]] = []
        self.open = False
        self.blank = ""  # whitespace waiting for a text block to open
        self.args = ""
        self.calls = 0

    def thinking(self, text: str) -> list[tuple[str, dict[str, Any]]]:
        out: list[tuple[str, dict[str, Any]]] = []
        if not text:
            return out
        if not self._open("thinking"):
            self.close(out)
            self._start(out, {"type": "thinking", "thinking": "", "signature": ""})
        self.content[-1]["thinking"] += text
        out.append(("content_block_delta", {"type": "content_block_delta", "index": len(self.content) - 1,
                                            "delta": {"type": "thinking_delta", "thinking": text}}))
        return out

    def _open(self, kind: str) -> bool:
        return self.open and self.content[-1]["type"] == kind

    def feed(self, events: list[ToolEvent]) -> list[tuple[str, dict[str, Any]]]:
        out: list[tuple[str, dict[str, Any]]] = []
        for e in events:
            if isinstance(e, TextPiece):
                text = self.blank + e.text
                if not self._open("text"):
                    if not text.strip():
                        self.blank = text
                        continue
                    self.close(out)
                    self._start(out, {"type": "text", "text": ""})
                self.blank = ""
                self.content[-1]["text"] += text
                out.append(("content_block_delta", {"type": "content_block_delta", "index": len(self.content) - 1,
                                                    "delta": {"type": "text_delta", "text": text}}))
            elif isinstance(e, CallStart):
                self.close(out)
                self.blank = ""
                self.args = ""
                self.calls += 1
                self._start(out, {"type": "tool_use", "id": e.id, "name": e.name, "input": {}})
            elif isinstance(e, ArgsPiece):
                self.args += e.text
                out.append(("content_block_delta", {"type": "content_block_delta", "index": len(self.content) - 1,
                                                    "delta": {"type": "input_json_delta", "partial_json": e.text}}))
            elif isinstance(e, CallEnd):
                try:
                    self.content[-1]["input"] = json.loads(self.args) if self.args else {}
                except ValueError:  # cut by max_tokens: the arguments are incomplete
                    self.content[-1]["input"] = {}
                self.close(out)
        return out

    def _start(self, out: list[tuple[str, dict[str, Any]]], block: dict[str, Any]) -> None:
        self.content.append(block)
        self.open = True
        start = dict(block, text="") if block["type"] == "text" else dict(block)
        out.append(("content_block_start", {"type": "content_block_start", "index": len(self.content) - 1,
                                            "content_block": start}))

    def close(self, out: list[tuple[str, dict[str, Any]]]) -> None:
        if self.open:
            self.open = False
            out.append(("content_block_stop", {"type": "content_block_stop", "index": len(self.content) - 1}))


def _stop_reason(finish: str | None, stop_sequence: str | None, calls: int) -> str:
    if finish == "length":
        return "max_tokens"
    if stop_sequence is not None:
        return "stop_sequence"
    return "tool_use" if calls else "end_turn"


async def _messages(state: ServerState, request: Request) -> Response:
    arrival = time.monotonic()
    req: MessagesRequest = parse(MessagesRequest, await read_body(request, state.config.max_body_bytes))
    check_model(state, req.model, request)
    msgs, tools, choice, cont = conversation(req, state.chat.parallel_default)
    if req.temperature is not None and req.temperature > TEMPERATURE_MAX:
        raise APIError(400, f"'temperature' must be in [0, 1] (got {req.temperature!r})", param="temperature")
    parser = state.chat.parser if choice.mode != "none" else None
    grammar = parser.grammar(tools, choice) if parser else None
    fmt = output_format(req)
    if grammar is not None and fmt is not None:
        raise APIError(400, "tool use cannot be combined with 'output_config.format'; set tool_choice "
                       "{\"type\": \"none\"} or drop the format", param="output_config.format")
    wants_thinking, budget = thinking_budget(req)
    if wants_thinking and state.reasoning is None:
        raise APIError(400, "'thinking' needs a model that thinks; this server has no reasoning parser (see "
                       "--reasoning-parser); remove 'thinking' or set its type to 'disabled'", param="thinking")
    prompt = await render_prompt(state, msgs, tools, continue_final=cont)  # (images: loaded and expanded)
    ids = prompt.ids
    think = state.thinking(ids, budget, "thinking.budget_tokens")
    constraint = grammar or fmt
    if think is not None:  # tools and the output format apply to the answer after the thinking
        constraint = think.grammar(constraint, budget)
    params = build_sampling(
        state.limits, prompt_len=len(ids), max_tokens=req.max_tokens, default_max_tokens=state.max_len,
        prompt_param="messages", grammar=constraint, prompt_note=prompt.note,
        temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, seed=req.seed, ignore_eos=req.ignore_eos,
        priority=req.priority, speculative=req.speculative, lora=adapter_of(state, req.model),
    )
    stops = stop_strings(req.stop_sequences, "stop_sequences")
    rid = new_id("msg", "_")
    started = await start_generation(state, request, [EnginePart(rid, ids, params, images=prompt.images)], stops,
                                     arrival,
                                     overload_status=OVERLOADED,
                                     special=think is not None and think.parser.special_tokens)
    if req.stream:
        return ClosingStream(_stream(state, started, rid, parser, think), on_close=started.handle.close,
                             media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    try:
        c = await until_disconnect(request, collect(started.gen, started.it, started.first))
    finally:
        started.handle.close()
    started.gen.done()
    text = "".join(c.texts[0])
    blocks = Blocks()
    if think is not None:
        split = think.split(text)
        blocks.thinking(split.reasoning)
        text = split.content
    ps = parser.stream(lambda: new_id("toolu", "_")) if parser else None
    blocks.feed((ps.feed(text) + ps.finish()) if ps else [TextPiece(text)])
    return JSONResponse({
        "id": rid, "type": "message", "role": "assistant", "model": state.model_name, "content": blocks.content,
        "stop_reason": _stop_reason(c.finish[0], c.stop_sequence.get(0), blocks.calls),
        "stop_sequence": c.stop_sequence.get(0), "usage": _usage(started.gen.usage), **_version(state, c.weight_version),
    })


def _version(state: ServerState, version: int | None) -> dict[str, Any]:
    """``weight_version`` (--enable-rl-api): the weights the message was generated with."""
    return {"weight_version": version} if state.config.enable_rl_api else {}


def _event(name: str, data: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n".encode()


async def _stream(state: ServerState, s: Started, rid: str, parser: ToolCallParser | None,
                  think: Thinking | None) -> AsyncIterator[bytes]:
    blocks = Blocks()
    ps: ToolCallStream | None = parser.stream(lambda: new_id("toolu", "_")) if parser else None
    rs = think.stream() if think is not None else None

    def events(d: Delta) -> list[bytes]:
        text = d.text
        out: list[tuple[str, dict[str, Any]]] = []
        if rs is not None:
            split = rs.feed(text) + (rs.finish() if d.finish_reason is not None else Split())
            out += blocks.thinking(split.reasoning)
            text = split.content
        if ps is None:
            evs: list[ToolEvent] = [TextPiece(text)] if text else []
        else:
            evs = ps.feed(text) + (ps.finish() if d.finish_reason is not None else [])
        out += blocks.feed(evs)
        return [_event(n, x) for n, x in out]

    try:
        yield _event("message_start", {"type": "message_start", "message": {
            "id": rid, "type": "message", "role": "assistant", "model": state.model_name, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": _usage(s.gen.usage),
            # (known: the first delta came before the stream began)
            **_version(state, s.gen.weight_version)}})
        yield _event("ping", {"type": "ping"})
        finish: Delta | None = None
        if s.first is not None:
            for b in events(s.first):
                yield b
            finish = s.first if s.first.finish_reason is not None else None
        async for d in s.it:
            for b in events(d):
                yield b
            if d.finish_reason is not None:
                finish = d
        s.gen.done()
        tail: list[tuple[str, dict[str, Any]]] = []
        blocks.close(tail)
        for n, x in tail:
            yield _event(n, x)
        stop_seq = finish.stop_sequence if finish else None
        yield _event("message_delta", {
            "type": "message_delta",
            "delta": {"stop_reason": _stop_reason(finish.finish_reason if finish else None, stop_seq, blocks.calls),
                      "stop_sequence": stop_seq},
            "usage": _usage(s.gen.usage), **_version(state, s.gen.weight_version)})
        yield _event("message_stop", {"type": "message_stop"})
    except APIError as e:
        # The status line is gone already: the error travels as an event, as Anthropic does.
        yield _event("error", e.anthropic_body())
