"""The OpenAI surface: ``POST /v1/chat/completions`` (with tool calling) and
``POST /v1/completions`` (with echo and prompt logprobs), whole answers or SSE streams.

tripod's extensions for the router's failover (``tripod.router``): ``return_token_ids`` (each
choice carries its token ids), ``tripod_failover`` (stream chunks carry each choice's resume point
under ``"tripod"``: the token ids of the delta and the characters of text delivered so far, on the
last chunk a delta makes; a whole answer comes as ``progress_stream``) and ``tripod_continuation``
(answer as the continuation of another replica's answer: same id and created, each choice resumed
from its tokens, a stream starting right after what the client has).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tripod.asgi import ClosingStream, until_disconnect
from tripod.protocol.sampling import GrammarSpec
from tripod.server.answer.generation import (
    SSE_DONE,
    Collected,
    CompletionLogprobs,
    Delta,
    chat_logprobs,
    collect,
    merge_logprobs,
    new_id,
    progress_stream,
    sse,
)
from tripod.server.answer.reasoning import ReasoningStream, Split, Thinking
from tripod.server.answer.tools import (
    ArgsPiece,
    CallStart,
    TextPiece,
    ToolCallParser,
    ToolCallStream,
    ToolEvent,
    parse_all,
)
from tripod.server.api.admission import Started, start_generation
from tripod.server.api.body import parse, read_body
from tripod.server.api.failover import mark_choice, resume_priors
from tripod.server.api.openai_requests import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_messages,
    grammar_spec,
    openai_tools,
)
from tripod.server.api.sampling import build_sampling, logit_bias_ids, stop_strings
from tripod.server.engine_client import EnginePart
from tripod.server.errors import APIError
from tripod.server.media.prompt import check_text, render_prompt
from tripod.server.state import ServerState, adapter_of, check_ids, check_model

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy default for /v1/completions


def add_openai_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _chat(state, request)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _completions(state, request)


def _sampling_fields(req: ChatCompletionRequest | CompletionRequest) -> dict[str, Any]:
    """The ``SamplingParams`` fields both OpenAI routes name the same way."""
    return {
        "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k, "min_p": req.min_p,
        "frequency_penalty": req.frequency_penalty, "presence_penalty": req.presence_penalty,
        "repetition_penalty": req.repetition_penalty, "seed": req.seed, "n": req.n,
        "stop_token_ids": req.stop_token_ids, "ignore_eos": req.ignore_eos, "priority": req.priority,
        "logit_bias": logit_bias_ids(req.logit_bias), "speculative": req.speculative,
    }


def _check_stream_options(req: ChatCompletionRequest | CompletionRequest) -> None:
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "'stream_options' is only allowed when 'stream' is true", param="stream_options")


# ---------------------------------------------------------------------- chat
async def _chat(state: ServerState, request: Request) -> Response:
    arrival = time.monotonic()
    req: ChatCompletionRequest = parse(ChatCompletionRequest, await read_body(request, state.config.max_body_bytes))
    check_model(state, req.model, request)
    tools, choice = openai_tools(req, state.chat.parallel_default)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    _check_stream_options(req)
    constraint = grammar_spec(req)  # (the request's own checks come before any image is fetched)
    prompt = await render_prompt(state, chat_messages(req.messages), tools)  # (images: loaded and expanded)
    ids = prompt.ids
    parser = state.chat.parser if choice.mode != "none" else None
    think = state.thinking(ids, req.thinking_budget)
    grammar = _one_constraint(parser.grammar(tools, choice) if parser else None, constraint)
    if think is not None:  # the constraint (tools, response_format) applies to the answer after the thinking
        grammar = think.grammar(grammar, req.thinking_budget)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    names = {"logprobs": "top_logprobs"}
    if req.max_completion_tokens is not None:
        names["max_tokens"] = "max_completion_tokens"
    params = build_sampling(
        state.limits, prompt_len=len(ids), max_tokens=max_tokens, default_max_tokens=state.max_len,
        names=names, prompt_param="messages", grammar=grammar, prompt_note=prompt.note,
        logprobs=(req.top_logprobs or 0) if req.logprobs else None, lora=adapter_of(state, req.model),
        **_sampling_fields(req),
    )
    stops = stop_strings(req.stop)
    cont = req.tripod_continuation
    # NOTE: the engine's request id is always new (the request a continuation continues may still be
    # winding down here); the answer's id is the continued one's.
    engine_rid = new_id("chatcmpl")
    rid = cont.id if cont is not None else engine_rid
    created = cont.created if cont is not None else int(time.time())
    parts = [EnginePart(engine_rid, ids, params, images=prompt.images)]
    priors = resume_priors(state, req, parts, params.n)
    started = await start_generation(state, request, parts, stops, arrival, priors=priors,
                                     special=think is not None and think.parser.special_tokens)
    if req.stream:
        body = _chat_stream(state, req, started, rid, created, parser, think)
        return ClosingStream(body, on_close=started.handle.close, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})

    def answer(c: Collected) -> dict[str, Any]:
        return _chat_body(state, req, c, rid, created, parser, think, started.gen.usage.body())

    if req.tripod_failover:
        return ClosingStream(progress_stream(started.gen, started.it, started.first, rid, created, answer),
                             on_close=started.handle.close, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})
    try:
        c = await until_disconnect(request, collect(started.gen, started.it, started.first))
    finally:
        started.handle.close()
    started.gen.done()
    return JSONResponse(answer(c))


def _chat_body(state: ServerState, req: ChatCompletionRequest, c: Collected, rid: str, created: int,
               parser: ToolCallParser | None, think: Thinking | None, usage: dict[str, Any]) -> dict[str, Any]:
    choices = []
    for idx in sorted(c.texts):
        text = "".join(c.texts[idx])
        finish = c.finish[idx]
        reasoning = None
        if think is not None:
            split = think.split(text)
            text, reasoning = split.content, split.reasoning or None
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if parser is not None:
            ans = parse_all(parser, text, lambda: new_id("call", "_"))
            if ans.calls:
                message = {"role": "assistant", "content": ans.text or None, "tool_calls": [
                    {"id": k.id, "type": "function", "function": {"name": k.name, "arguments": k.arguments}}
                    for k in ans.calls]}
                finish = "tool_calls" if finish == "stop" else finish
            else:
                message["content"] = ans.text
        if think is not None:
            if not message["content"] and reasoning:
                message["content"] = None  # (all thinking: cut by max_tokens)
            message["reasoning_content"] = reasoning
        choice = {
            "index": idx, "message": message,
            "logprobs": {"content": chat_logprobs(state.text, c.logprobs[idx])} if req.logprobs else None,
            "finish_reason": finish,
        }
        if req.return_token_ids:
            choice["token_ids"] = c.token_ids[idx]
        choices.append(choice)
    return {
        "id": rid, "object": "chat.completion", "created": created, "model": state.model_name,
        "choices": choices, "usage": usage, "system_fingerprint": state.fingerprint(), **_version(state, c),
    }


def _one_constraint(tool_grammar: GrammarSpec | None, other: GrammarSpec | None) -> GrammarSpec | None:
    if tool_grammar is not None and other is not None:
        raise APIError(400, "tool calls cannot be combined with another output constraint (response_format, "
                       "regex, ...); set 'tool_choice': 'none' or drop the constraint", param="tool_choice")
    return tool_grammar or other


def _tool_delta(e: ToolEvent) -> dict[str, Any] | None:
    if isinstance(e, TextPiece):
        return {"content": e.text}
    if isinstance(e, CallStart):
        return {"tool_calls": [{"index": e.index, "id": e.id, "type": "function",
                                "function": {"name": e.name, "arguments": ""}}]}
    if isinstance(e, ArgsPiece):
        return {"tool_calls": [{"index": e.index, "function": {"arguments": e.text}}]}
    return None  # CallEnd: OpenAI's stream has no event for it


class _ChatChunks:
    """A chat stream's deltas → SSE chunks: the text, or (with tools) the parser's tool-call
    events per choice, each choice's last chunk of a delta marked with its token ids. A model
    that thinks: its thinking as ``delta.reasoning_content`` first, the rest from its answer."""

    def __init__(self, state: ServerState, req: ChatCompletionRequest, rid: str, created: int,
                 parser: ToolCallParser | None, think: Thinking | None = None) -> None:
        self.state, self.req, self.parser, self.think = state, req, parser, think
        self.thoughts: dict[int, ReasoningStream] = {}
        self.head: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": created,
                                     "model": state.model_name, "system_fingerprint": state.fingerprint()}
        self.include_usage = bool(req.stream_options and req.stream_options.include_usage)
        self.streams: dict[int, ToolCallStream] = {}
        self.called: set[int] = set()
        self.unsent: dict[int, list[int]] = {}  # token ids of deltas that made no chunk (the parser held their text)

    def chunk(self, choices: list[dict[str, Any]], usage: Any = None) -> bytes:
        body = {**self.head, "choices": choices}
        if self.include_usage:
            body["usage"] = usage
        return sse(body)

    def __call__(self, d: Delta) -> list[bytes]:
        lps = {"content": chat_logprobs(self.state.text, d.logprobs)} if self.req.logprobs else None
        deltas, finish = self._deltas(d, lps is not None)
        last = len(deltas) - 1
        ids = self.unsent.pop(d.index, []) + d.token_ids
        if not deltas:
            self.unsent[d.index] = ids  # NOTE: reported with the next chunk: token ids stay complete, in order
        out = []
        for j, delta in enumerate(deltas):
            choice = {"index": d.index, "delta": delta, "logprobs": lps if j == 0 else None,
                      "finish_reason": finish if j == last else None}
            out.append(self.chunk([mark_choice(choice, self.req, ids, d.chars) if j == last else choice]))
        return out

    def _deltas(self, d: Delta, has_logprobs: bool) -> tuple[list[dict[str, Any]], str | None]:
        """The ``delta`` objects ``d`` makes, and its finish reason as the client sees it."""
        finish = d.finish_reason
        if self.parser is None and self.think is None:
            return ([{"content": d.text}] if d.text or finish is None else [{}]), finish
        text, replayed = d.text, d.replayed
        deltas: list[dict[str, Any]] = []
        if self.think is not None:
            rs = self.thoughts.setdefault(d.index, self.think.stream())
            if replayed:  # a continued stream: what the client has, fed to the splitter silently
                replayed = rs.feed(replayed).content
            split = rs.feed(text) + (rs.finish() if finish is not None else Split())
            if split.reasoning:
                deltas.append({"reasoning_content": split.reasoning})
            text = split.content
        if self.parser is None:
            if text:
                deltas.append({"content": text})
            if not deltas and (has_logprobs or finish is not None):
                deltas = [{}]
            return deltas, finish
        ps = self.streams.setdefault(d.index, self.parser.stream(lambda: new_id("call", "_")))
        if replayed:  # a continued stream: what the client has, fed to the parser silently
            if any(isinstance(e, CallStart) for e in ps.feed(replayed)):
                self.called.add(d.index)
        events = ps.feed(text) + (ps.finish() if finish is not None else [])
        if any(isinstance(e, CallStart) for e in events):
            self.called.add(d.index)
        deltas += [x for x in map(_tool_delta, events) if x is not None]
        if finish == "stop" and d.index in self.called:
            finish = "tool_calls"
        if not deltas and (has_logprobs or finish is not None):
            deltas = [{}]
        return deltas, finish


async def _chat_stream(state: ServerState, req: ChatCompletionRequest, s: Started, rid: str, created: int,
                       parser: ToolCallParser | None, think: Thinking | None) -> AsyncIterator[bytes]:
    chunks = _ChatChunks(state, req, rid, created, parser, think)
    if state.config.enable_rl_api:  # (known: the first delta came before the stream began)
        chunks.head["weight_version"] = s.gen.weight_version
    try:
        indices = sorted(q.index for q in s.gen.seqs.values())
        if req.tripod_continuation is None:  # a continued stream's client has its role chunk
            yield chunks.chunk([mark_choice({"index": i, "delta": {"role": "assistant", "content": ""},
                                             "logprobs": None, "finish_reason": None}, req, [], 0) for i in indices])
        if s.first is not None:
            for b in chunks(s.first):
                yield b
        async for d in s.it:
            for b in chunks(d):
                yield b
        s.gen.done()
        if chunks.include_usage:
            yield chunks.chunk([], s.gen.usage.body())
    except APIError as e:
        # The status line is gone already; the error travels as an event, as OpenAI does.
        yield sse(e.body())
    yield SSE_DONE


# ---------------------------------------------------------------------- completions
async def _completions(state: ServerState, request: Request) -> Response:
    arrival = time.monotonic()
    req: CompletionRequest = parse(CompletionRequest, await read_body(request, state.config.max_body_bytes))
    check_model(state, req.model, request)
    if req.suffix:
        raise APIError(400, "'suffix' is not supported by tripod; remove it", param="suffix")
    if req.best_of is not None and req.best_of != (req.n or 1):
        raise APIError(400, "'best_of' is not supported by tripod; remove it or set it equal to 'n'",
                       param="best_of")
    _check_stream_options(req)
    _check_routed_experts(state, req)
    # echo + max_tokens 0: OpenAI's idiom for scoring a text (the prompt's logprobs, nothing
    # generated). The engine generates one token, which the answer leaves out.
    score_only = req.echo and req.max_tokens == 0
    prompts = prompt_ids(state, req.prompt)
    cont = req.tripod_continuation
    engine_rid = new_id("cmpl")  # (new even for a continuation: see _chat)
    rid = cont.id if cont is not None else engine_rid
    created = cont.created if cont is not None else int(time.time())
    grammar = grammar_spec(req)
    stops = stop_strings(req.stop)
    parts = []
    for i, ids in enumerate(prompts):
        params = build_sampling(
            state.limits, prompt_len=len(ids), max_tokens=1 if score_only else req.max_tokens,
            default_max_tokens=COMPLETIONS_DEFAULT_MAX_TOKENS, grammar=grammar, logprobs=req.logprobs,
            # echo + logprobs: the echoed prompt's tokens get logprobs too (the first has none).
            prompt_logprobs=req.logprobs if req.echo else None, lora=adapter_of(state, req.model),
            return_routed_experts=req.return_routed_experts or None, **_sampling_fields(req),
        )
        parts.append(EnginePart(engine_rid if len(prompts) == 1 else f"{engine_rid}-p{i}", ids, params))
    n = parts[0].params.n
    priors = resume_priors(state, req, parts, n)
    started = await start_generation(state, request, parts, stops, arrival, priors=priors)
    echo = [state.text.decode(p.prompt_ids) for p in parts] if req.echo else None
    if req.stream:
        body = _completion_stream(state, req, started, rid, created, echo, n, score_only)
        return ClosingStream(body, on_close=started.handle.close, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})

    def answer(c: Collected) -> dict[str, Any]:
        return _completion_body(state, req, c, rid, created, echo, n, score_only, _usage(started, score_only))

    if req.tripod_failover:
        return ClosingStream(progress_stream(started.gen, started.it, started.first, rid, created, answer),
                             on_close=started.handle.close, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})
    try:
        c = await until_disconnect(request, collect(started.gen, started.it, started.first))
    finally:
        started.handle.close()
    started.gen.done()
    return JSONResponse(answer(c))


def _completion_body(state: ServerState, req: CompletionRequest, c: Collected, rid: str, created: int,
                     echo: list[str] | None, n: int, score_only: bool, usage: dict[str, Any]) -> dict[str, Any]:
    choices = []
    for idx in sorted(c.texts):
        prefix = echo[idx // n] if echo else ""
        generated = [] if score_only else c.logprobs[idx]
        lps = None
        if req.logprobs is not None:
            b = CompletionLogprobs(state.text, len(prefix))
            if echo:
                b.offset = 0
                lps = merge_logprobs(b.body(c.prompt_logprobs.get(idx, [])), b.body(generated))
            else:
                lps = b.body(generated)
        choice = {"index": idx, "text": prefix + ("" if score_only else "".join(c.texts[idx])),
                  "logprobs": lps, "finish_reason": "length" if score_only else c.finish[idx]}
        if req.return_token_ids:
            choice["token_ids"] = c.token_ids[idx]
        if req.return_routed_experts:
            choice["routed_experts"] = c.routed_experts.get(idx)
        choices.append(choice)
    return {
        "id": rid, "object": "text_completion", "created": created, "model": state.model_name,
        "choices": choices, "usage": usage, "system_fingerprint": state.fingerprint(), **_version(state, c),
    }


def _check_routed_experts(state: ServerState, req: CompletionRequest) -> None:
    """``return_routed_experts`` is an RL control (routing replay), answered in a whole answer."""
    if not req.return_routed_experts:
        return
    if not state.config.enable_rl_api:
        raise APIError(400, "'return_routed_experts' needs a server started with --enable-rl-api",
                       param="return_routed_experts")
    if req.stream or req.tripod_failover:
        raise APIError(400, "'return_routed_experts' comes in a whole answer; set 'stream' to false",
                       param="return_routed_experts")


def _version(state: ServerState, c: Collected) -> dict[str, Any]:
    """``weight_version`` (--enable-rl-api): the weights the answer was generated with."""
    return {"weight_version": c.weight_version} if state.config.enable_rl_api else {}


def _usage(s: Started, score_only: bool) -> dict[str, Any]:
    u = s.gen.usage.body()
    if score_only:  # the one token generated to score the prompt is not the caller's
        u["completion_tokens"] = 0
        u["total_tokens"] = u["prompt_tokens"]
    return u


async def _completion_stream(state: ServerState, req: CompletionRequest, s: Started, rid: str, created: int,
                             echo: list[str] | None, n: int, score_only: bool) -> AsyncIterator[bytes]:
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    fp = state.fingerprint()
    version = {"weight_version": s.gen.weight_version} if state.config.enable_rl_api else {}
    builders: dict[int, CompletionLogprobs] = {}
    echoed: set[int] = set()
    for idx, prior in s.gen.priors.items():
        # A continued stream: the client has the echo, and text_offset goes on after the tokens it has.
        echoed.add(idx)
        before = len(echo[idx // n]) if echo else 0
        builders[idx] = CompletionLogprobs(state.text, before + sum(len(state.text.piece(t)) for t in prior.token_ids))

    def chunk(choices: list[dict[str, Any]], usage: Any = None) -> bytes:
        body: dict[str, Any] = {"id": rid, "object": "text_completion", "created": created,
                                "model": state.model_name, "system_fingerprint": fp, "choices": choices, **version}
        if include_usage:
            body["usage"] = usage
        return sse(body)

    def chunks(d: Delta) -> list[bytes]:
        out = []
        b = builders.setdefault(d.index, CompletionLogprobs(state.text, 0))
        if echo and d.index not in echoed:
            # The echoed prompt goes first, with its logprobs (they come with the first delta).
            echoed.add(d.index)
            plp = b.body(d.prompt_logprobs or []) if req.logprobs is not None else None
            if plp is None:
                b.offset = len(echo[d.index // n])
            out.append(chunk([{"index": d.index, "text": echo[d.index // n], "logprobs": plp,
                               "finish_reason": None}]))
        if score_only:
            if d.finish_reason is not None:
                out.append(chunk([{"index": d.index, "text": "", "logprobs": None, "finish_reason": "length"}]))
            return out
        lps = b.body(d.logprobs) if req.logprobs is not None else None
        out.append(chunk([mark_choice({"index": d.index, "text": d.text, "logprobs": lps, "finish_reason": d.finish_reason},
                                req, d.token_ids, d.chars)]))
        return out

    try:
        if s.first is not None:
            for x in chunks(s.first):
                yield x
        async for d in s.it:
            for x in chunks(d):
                yield x
        s.gen.done()
        if include_usage:
            yield chunk([], _usage(s, score_only))
    except APIError as e:
        yield sse(e.body())
    yield SSE_DONE


def prompt_ids(state: ServerState, prompt: Any) -> list[list[int]]:
    if isinstance(prompt, str):
        prompts: list[Any] = [prompt]
    elif prompt and isinstance(prompt[0], int):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if not prompts:
        raise APIError(400, "'prompt' must not be empty", param="prompt")
    if len(prompts) > state.config.max_n * 8:
        raise APIError(400, f"at most {state.config.max_n * 8} prompts per request", param="prompt")
    out = []
    for p in prompts:
        if isinstance(p, str):
            if not p:
                raise APIError(400, "'prompt' must not be empty", param="prompt")
            out.append(state.text.encode(p))
        else:
            if not p:
                raise APIError(400, "'prompt' token lists must not be empty", param="prompt")
            check_ids(state, p, "prompt")
            out.append(list(p))
    for ids in out:
        check_text(state, ids, "prompt")  # (a completion has no images)
    return out

