"""The Responses surface: ``POST /v1/responses`` (whole answers, typed event streams, background
runs), ``GET /v1/responses/{id}`` (``?stream=true&starting_after=N`` replays a background run's
events), ``GET /v1/responses/{id}/input_items``, ``DELETE /v1/responses/{id}`` and
``POST /v1/responses/{id}/cancel``.

A request's conversation is the stored conversation of its ``previous_response_id`` (every earlier
turn's input and output items, function calls, their outputs and reasoning included) followed by
its own ``input``; it is rendered with the chat template exactly as the same conversation sent to
``/v1/chat/completions`` (``responses_requests.to_messages``), so greedy answers are the same.
Stored records (``store``, default true) go to ``state.responses`` (``server/response_store.py``)
under the caller's tenant: another tenant's id is a 404.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tripod.asgi import ClosingStream, until_disconnect
from tripod.server.answer.generation import new_id, sse
from tripod.server.answer.response_events import Event, ResponseBuilder, events_sse
from tripod.server.api.admission import Started, start_generation
from tripod.server.api.body import parse, read_body
from tripod.server.api.responses_requests import (
    ResponsesRequest,
    check_request,
    normal_items,
    responses_tools,
    text_grammar,
    to_messages,
)
from tripod.server.api.sampling import build_sampling, stop_strings
from tripod.server.engine_client import EnginePart
from tripod.server.errors import APIError
from tripod.server.media.prompt import render_prompt
from tripod.server.response_store import StoredResponse, StoreFull
from tripod.server.run_owner import instance_id
from tripod.server.state import ServerState, adapter_of, check_model
from tripod.tenants import DEFAULT_TENANT, record_of


@dataclass(slots=True)
class _Run:
    """A background response in this process: its task, and its events so far (for replay).
    NOTE: ``events`` only grows, under ``cond``; readers wait on ``cond`` for more or the end."""

    task: asyncio.Task[None] | None = None
    events: list[Event] = field(default_factory=list)
    cond: asyncio.Condition = field(default_factory=asyncio.Condition)
    done: bool = False

    async def add(self, events: list[Event]) -> None:
        async with self.cond:
            self.events.extend(events)
            self.cond.notify_all()

    async def end(self) -> None:
        async with self.cond:
            self.done = True
            self.cond.notify_all()


@dataclass(slots=True)
class _Prepared:
    """A request checked and rendered, ready to start."""

    req: ResponsesRequest
    rid: str
    items: list[dict[str, Any]]  # this turn's input items
    history: list[dict[str, Any]]  # the conversation before it
    parts: list[EnginePart]
    stops: list[str]
    builder: ResponseBuilder
    special: bool


def tenant_of(request: Request) -> str:
    rec = record_of(request.scope)
    return rec.identity.tenant.name if rec is not None else DEFAULT_TENANT


def add_responses_routes(app: FastAPI, state: ServerState) -> None:
    runs: dict[str, _Run] = {}

    @app.post("/v1/responses")
    async def create(request: Request) -> Response:
        arrival = time.monotonic()
        p = await _prepare(state, request, parse(ResponsesRequest, await read_body(request,
                                                                                   state.config.max_body_bytes)))
        if p.req.background:
            return await _background(state, request, p, runs, arrival)
        started = await start_generation(state, request, p.parts, p.stops, arrival, special=p.special)
        _stamp_version(state, p, started)
        if p.req.stream:
            body = _stream(state, request, p, started)
            return ClosingStream(body, on_close=started.handle.close, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
        try:
            await until_disconnect(request, _collect(started, p.builder))
        finally:
            started.handle.close()
        started.gen.done()
        await _store(state, p, tenant_of(request))
        return JSONResponse(p.builder.snapshot())

    @app.get("/v1/responses/{rid}")
    async def retrieve(rid: str, request: Request) -> Response:
        rec = _found(state, request, rid)
        if request.query_params.get("stream") in ("true", "1"):
            run = runs.get(rid)
            if run is None:
                raise APIError(400, "only a background response can be streamed again; this one is "
                               f"{rec.body.get('status')}", param="stream")
            after = _int_param(request, "starting_after", -1)
            return ClosingStream(_replay(run, after), on_close=lambda: None, media_type="text/event-stream")
        return JSONResponse(rec.body)

    @app.get("/v1/responses/{rid}/input_items")
    async def input_items(rid: str, request: Request) -> Response:
        return JSONResponse(_page(request, _found(state, request, rid).input_items))

    @app.delete("/v1/responses/{rid}")
    async def delete(rid: str, request: Request) -> Response:
        if not state.responses.delete(rid, tenant_of(request)):
            raise _not_found(rid)
        return JSONResponse({"id": rid, "object": "response", "deleted": True})

    @app.post("/v1/responses/{rid}/cancel")
    async def cancel(rid: str, request: Request) -> Response:
        rec = _found(state, request, rid)
        run = runs.get(rid)
        if not rec.body.get("background"):
            raise APIError(400, "only a background response can be cancelled", param="response_id")
        if run is None and rec.body.get("status") in ("queued", "in_progress"):
            # NOTE: its run lives in another replica (sharing this store); a router asks each in turn.
            raise APIError(404, f"the response {rid!r} is running in another process; cancel it there",
                           param="response_id", code="response_running_elsewhere")
        if run is not None and run.task is not None and not run.done:
            run.task.cancel()
            await asyncio.gather(run.task, return_exceptions=True)
        rec = _found(state, request, rid)
        return JSONResponse(rec.body)


def _not_found(rid: str) -> APIError:
    return APIError(404, f"no response with id {rid!r} is stored here (it was never stored, was deleted, "
                    "expired, or belongs to another tenant)", param="response_id", code="response_not_found")


def _found(state: ServerState, request: Request, rid: str) -> StoredResponse:
    rec = state.responses.get(rid, tenant_of(request))
    if rec is None:
        raise _not_found(rid)
    return rec


def _int_param(request: Request, name: str, default: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise APIError(400, f"'{name}' must be an integer (got {raw!r})", param=name) from None


def _page(request: Request, items: list[dict[str, Any]]) -> dict[str, Any]:
    """``input_items``'s list page: ``order`` (desc by default, as OpenAI), ``after``, ``limit``."""
    order = request.query_params.get("order", "desc")
    if order not in ("asc", "desc"):
        raise APIError(400, f"'order' must be 'asc' or 'desc' (got {order!r})", param="order")
    limit = _int_param(request, "limit", 20)
    if not 1 <= limit <= 100:
        raise APIError(400, f"'limit' must be between 1 and 100 (got {limit})", param="limit")
    seq = items if order == "asc" else items[::-1]
    after = request.query_params.get("after")
    if after is not None:
        ids = [it["id"] for it in seq]
        if after not in ids:
            raise APIError(400, f"'after' names no item of this response ({after!r})", param="after")
        seq = seq[ids.index(after) + 1:]
    data = seq[:limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(seq) > limit}


def _history(state: ServerState, request: Request, prev: str | None) -> list[dict[str, Any]]:
    """The conversation a follow-up continues: its previous response's input and output."""
    if prev is None:
        return []
    rec = state.responses.get(prev, tenant_of(request))
    if rec is None:
        raise APIError(400, f"'previous_response_id': no stored response {prev!r} (never stored, deleted, "
                       "expired or another tenant's); send the whole conversation as 'input' instead",
                       param="previous_response_id", code="previous_response_not_found")
    if rec.body.get("status") not in ("completed", "incomplete"):
        raise APIError(400, f"'previous_response_id': the response {prev!r} is {rec.body.get('status')}; "
                       "continue from a completed one", param="previous_response_id")
    return [*rec.history, *rec.input_items,
            *[it for it in rec.body["output"] if it["type"] in ("message", "function_call", "reasoning")]]


async def _prepare(state: ServerState, request: Request, req: ResponsesRequest) -> _Prepared:
    check_model(state, req.model, request)
    logprobs = check_request(req)
    items = normal_items(req.input)
    history = _history(state, request, req.previous_response_id)
    tools, choice, echoed = responses_tools(req, state.chat.parallel_default)
    constraint, text_echo = text_grammar(req)
    messages = to_messages([*history, *items], req.instructions, len(history))
    prompt = await render_prompt(state, messages, tools, param="input")  # (images: loaded and expanded)
    if req.truncation == "auto":  # drop the oldest turns (never the instructions) until it fits
        keep = 1 if req.instructions else 0
        # (with room for the output asked for: at least one token)
        budget = req.max_output_tokens if isinstance(req.max_output_tokens, int) and req.max_output_tokens > 0 else 1
        while len(prompt.ids) + budget > state.max_len and len(messages) > keep + 1:
            del messages[keep]
            while len(messages) > keep + 1 and messages[keep].role != "user":
                del messages[keep]  # (the rest of that turn: the conversation starts with a user turn)
            # (the images kept are not loaded again; those of the turns dropped are left out)
            prompt = await render_prompt(state, messages, tools, param="input", pictures=prompt.pictures)
    ids = prompt.ids
    parser = state.chat.parser if choice.mode != "none" else None
    think = state.thinking(ids)
    grammar = parser.grammar(tools, choice) if parser else None
    if grammar is not None and constraint is not None:
        raise APIError(400, "tool calls cannot be combined with 'text.format'; set 'tool_choice': 'none' or use "
                       "the text format", param="tool_choice")
    grammar = grammar or constraint
    if think is not None:
        grammar = think.grammar(grammar, None)
    params = build_sampling(
        state.limits, prompt_len=len(ids), max_tokens=req.max_output_tokens, default_max_tokens=state.max_len,
        names={"max_tokens": "max_output_tokens", "logprobs": "top_logprobs"}, prompt_param="input",
        grammar=grammar, prompt_note=prompt.note, logprobs=(req.top_logprobs or 0) if logprobs else None, lora=adapter_of(state, req.model),
        temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p, seed=req.seed,
        frequency_penalty=req.frequency_penalty, presence_penalty=req.presence_penalty,
        repetition_penalty=req.repetition_penalty, priority=req.priority, ignore_eos=req.ignore_eos)
    rid = new_id("resp", "_")
    tc = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
    base = {
        "id": rid, "object": "response", "created_at": int(time.time()), "error": None, "incomplete_details": None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": state.model_name,
        "parallel_tool_calls": choice.parallel, "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": (req.reasoning or {}).get("effort"), "summary": (req.reasoning or {}).get("summary")},
        "store": req.store, "temperature": req.temperature if req.temperature is not None else 1.0,
        "text": text_echo, "tool_choice": tc, "tools": echoed, "top_p": req.top_p if req.top_p is not None else 1.0,
        "top_logprobs": req.top_logprobs, "truncation": req.truncation or "disabled", "user": req.user,
        "metadata": req.metadata or {}, "background": req.background,
    }
    builder = ResponseBuilder(base, state.text, parser, think, logprobs)
    return _Prepared(req, rid, items, history, [EnginePart(rid, ids, params, images=prompt.images)],
                     stop_strings(req.stop), builder,
                     think is not None and think.parser.special_tokens)


def _stamp_version(state: ServerState, p: _Prepared, s: Started) -> None:
    """``weight_version`` (--enable-rl-api) in the response object: every snapshot of it (the
    events' ``response``, the whole answer, the stored record) then names the weights it ran on.
    Known before the first event: ``start_generation`` waited for the first delta, which carries it."""
    if state.config.enable_rl_api:
        p.builder.body["weight_version"] = s.gen.weight_version


async def _events(s: Started, b: ResponseBuilder) -> AsyncIterator[list[Event]]:
    """Every delta of ``s`` fed to ``b``: its events, batch by batch, the whole response last."""
    yield b.start()
    finish: str | None = None
    if s.first is not None:
        finish = s.first.finish_reason
        yield b.feed(s.first)
    async for d in s.it:
        finish = d.finish_reason or finish
        yield b.feed(d)
    yield b.finish(finish, s.gen.usage.body())


async def _collect(s: Started, b: ResponseBuilder) -> None:
    async for _ in _events(s, b):
        pass


async def _store(state: ServerState, p: _Prepared, tenant: str) -> None:
    """Store ``p``'s response as it is now. NOTE: in a thread: a durable put waits for the disk
    (a few ms with sqlite's synchronous=FULL), which must not stall the other requests' streams."""
    if not p.req.store:
        return
    rec = StoredResponse(p.rid, tenant, p.builder.snapshot(), p.items, p.req.previous_response_id, time.time(),
                         p.history, owner=instance_id() if p.req.background else None)
    try:
        await asyncio.to_thread(state.responses.put, rec)
    except StoreFull as e:
        raise APIError(400, str(e), param="store") from None


def _final(events: list[Event]) -> bool:
    return bool(events) and events[-1]["type"] in ("response.completed", "response.incomplete")


async def _stream(state: ServerState, request: Request, p: _Prepared, s: Started) -> AsyncIterator[bytes]:
    tenant = tenant_of(request)
    try:
        async for evs in _events(s, p.builder):
            if _final(evs):  # NOTE: stored before the client sees the end, so a retrieve right after finds it
                s.gen.done()
                await _store(state, p, tenant)
            yield events_sse(evs, sse)
    except APIError as e:
        # The status line is gone: the failure travels as the stream's last event, as OpenAI's does.
        evs = p.builder.fail(e.code or "server_error", e.message)
        await _store(state, p, tenant)
        yield events_sse(evs, sse)


async def _background(state: ServerState, request: Request, p: _Prepared, runs: dict[str, _Run],
                      arrival: float) -> Response:
    """Admit and start ``p``, store it in progress and answer at once; the run goes on detached
    (the client leaving does not stop it; ``/cancel`` does) and stores its end."""
    started = await start_generation(state, request, p.parts, p.stops, arrival, special=p.special)
    _stamp_version(state, p, started)
    tenant = tenant_of(request)
    run = runs[p.rid] = _Run()
    it = _events(started, p.builder)
    first = await anext(it)  # response.created / in_progress: the stored record says in_progress
    await run.add(first)
    await _store(state, p, tenant)

    async def go() -> None:
        try:
            async for evs in it:
                if _final(evs):  # (stored before a replay shows the end: see _stream)
                    started.gen.done()
                    await _store(state, p, tenant)
                await run.add(evs)
        except asyncio.CancelledError:
            evs = p.builder.fail("cancelled", "cancelled by the caller", status="cancelled")
            await _store(state, p, tenant)
            await run.add(evs)
        except APIError as e:
            evs = p.builder.fail(e.code or "server_error", e.message)
            await _store(state, p, tenant)
            await run.add(evs)
        finally:
            started.handle.close()
            await run.end()

    run.task = asyncio.create_task(go())
    return JSONResponse(p.builder.snapshot())


async def _replay(run: _Run, after: int) -> AsyncIterator[bytes]:
    """A background run's events after sequence number ``after``: those so far, then as they come."""
    seen = [0]  # events relayed so far (a cell: the predicate reads its current value)
    while True:
        async with run.cond:
            await run.cond.wait_for(lambda: len(run.events) > seen[0] or run.done)
            batch, done = run.events[seen[0]:], run.done
        seen[0] += len(batch)
        i = seen[0]
        frames = [e for e in batch if e["sequence_number"] > after]
        if frames:
            yield events_sse(frames, sse)
        if done and i == len(run.events):
            return
