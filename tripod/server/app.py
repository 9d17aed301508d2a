"""The HTTP process: FastAPI routes of the OpenAI API, auth, limits, health and metrics.

``build_app`` wires a ``ServerState`` (tokenizer, engine client, metrics, config) into the routes.
Every error a caller can cause is answered with OpenAI's error body and a 4xx; the engine is only
reached by requests that passed every check.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tripod.asgi import ClosingStream
from tripod.config import EngineConfig, ServerConfig
from tripod.server.engine_client import EngineClient, EngineDead, EnginePart, Overloaded
from tripod.server.generation import (
    SSE_DONE,
    CompletionLogprobs,
    Delta,
    Generation,
    chat_logprobs,
    collect,
    new_id,
    sse,
)
from tripod.server.metrics import ServerMetrics
from tripod.server.protocol import (
    MAX_TOP_LOGPROBS,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    chat_messages,
    grammar_spec,
    parse,
    sampling_params,
)
from tripod.server.text import ChatTemplateError, TextSide

log = logging.getLogger("tripod.server")
T = TypeVar("T")

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy default for /v1/completions


@dataclass
class ServerState:
    """Everything the routes share. ``exit_code`` is what the process exits with."""

    engine_config: EngineConfig
    config: ServerConfig
    text: TextSide
    client: EngineClient
    model_name: str
    quantization: str
    metrics: ServerMetrics
    created: int = field(default_factory=lambda: int(time.time()))
    draining: bool = False
    exit_code: int = 0
    request_shutdown: Callable[[], None] | None = None

    @property
    def max_len(self) -> int:
        info = self.client.info
        assert info is not None
        return info.max_request_len


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready."""


# ---------------------------------------------------------------------- middleware
_OPEN_PATHS = ("/health", "/metrics")


class GuardMiddleware:
    """Pure ASGI (so streaming and disconnects pass through untouched): API key, body size,
    and the per-route status counter."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state
        key = state.config.api_key
        self._expected = f"Bearer {key}".encode() if key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        status_box = [500]

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status_box[0] = message["status"]
            await send(message)

        try:
            headers = dict(scope["headers"])
            if self._expected is not None and path not in _OPEN_PATHS:
                got = headers.get(b"authorization", b"")
                # NOTE: constant-time comparison; a timing side channel must not leak the key.
                if not hmac.compare_digest(got, self._expected):
                    why = "no API key was given" if not got else "the API key is not valid"
                    await _error_response(APIError(
                        401, f"{why}; send 'Authorization: Bearer <key>'", type="invalid_request_error",
                        code="invalid_api_key",
                    ))(scope, receive, counting_send)
                    return
            length = headers.get(b"content-length")
            if length is not None:
                try:
                    too_big = int(length) > self.state.config.max_body_bytes
                except ValueError:
                    too_big = False
                if too_big:
                    await _error_response(_too_large(self.state.config.max_body_bytes))(
                        scope, receive, counting_send
                    )
                    return
            await self.app(scope, receive, counting_send)
        finally:
            route = path if path in _ROUTES else "other"
            self.state.metrics.http_requests.labels(route, str(status_box[0])).inc()


_ROUTES = {
    "/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics",
    "/tokenize", "/detokenize", "/debug/engine",
}


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than {limit} bytes; send less", code="body_too_large")


def _error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def _read_body(request: Request, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


async def _until_disconnect(request: Request, aw: Awaitable[T]) -> T:
    """Await ``aw`` unless the client goes away first (then raise ``ClientGone``)."""
    task = asyncio.ensure_future(aw)

    async def disconnected() -> None:
        # NOTE: the body was read already, so the next ASGI message can only be the disconnect.
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watch.cancel()
        raise
    if task in done:
        watch.cancel()
        return task.result()
    task.cancel()
    raise ClientGone()


# ---------------------------------------------------------------------- the app
def build_app(state: ServerState, lifespan: Any = None) -> FastAPI:
    app = FastAPI(title="tripod", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.tripod = state
    app.add_middleware(GuardMiddleware, state=state)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return _error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        msg = {404: "no such route; see /v1/models, /v1/chat/completions, /v1/completions",
               405: "this method is not allowed on this route"}.get(e.status_code, str(e.detail))
        return _error_response(APIError(e.status_code, msg))

    @app.exception_handler(ClientGone)
    async def _gone(_: Request, e: ClientGone) -> Response:
        return Response(status_code=499)

    @app.get("/health")
    async def health() -> JSONResponse:
        c = state.client
        if not c.alive:
            return JSONResponse({"status": "dead", "reason": c.dead_reason}, status_code=503)
        if state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({
            "status": "ok", "model": state.model_name, "engine_pid": c.pid,
            "running": c.stats.get("running", 0), "waiting": c.stats.get("waiting", 0),
        })

    @app.get("/metrics")
    async def metrics() -> Response:
        state.metrics.engine_alive.set(1 if state.client.alive else 0)
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [_model_card(state)]})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> JSONResponse:
        _check_model(state, model_id)
        return JSONResponse(_model_card(state))

    @app.get("/debug/engine")
    async def debug_engine() -> JSONResponse:
        """The engine's own accounting (KV slots, queues; the KV invariant when idle)."""
        try:
            stats = await state.client.engine_stats()
        except EngineDead as e:
            raise APIError(503, str(e), type="server_error", code="engine_dead") from None
        return JSONResponse({**stats, "inflight": state.client.inflight})

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        req: TokenizeRequest = parse(TokenizeRequest, await _read_body(request, state.config.max_body_bytes))
        _check_model(state, req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of 'prompt' or 'messages'")
        if req.messages is not None:
            ids = _chat_ids(state, req.messages)
        else:
            assert req.prompt is not None
            ids = state.text.encode(req.prompt, special=req.add_special_tokens)
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": state.max_len})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        req: DetokenizeRequest = parse(DetokenizeRequest, await _read_body(request, state.config.max_body_bytes))
        _check_model(state, req.model)
        _check_ids(state, req.tokens, "tokens")
        return JSONResponse({"prompt": state.text.decode(req.tokens, skip_special_tokens=False)})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        arrival = time.monotonic()
        req: ChatCompletionRequest = parse(
            ChatCompletionRequest, await _read_body(request, state.config.max_body_bytes)
        )
        _check_model(state, req.model)
        if req.tools:
            raise APIError(400, "'tools' (function calling) is not supported by tripod yet; remove it", param="tools")
        ids = _chat_ids(state, req.messages)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        lp = None
        if req.logprobs:
            lp = req.top_logprobs or 0
            if not 0 <= lp <= MAX_TOP_LOGPROBS:
                raise APIError(400, f"'top_logprobs' must be between 0 and {MAX_TOP_LOGPROBS} (got {lp})",
                               param="top_logprobs")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params, stops = sampling_params(
            req, max_tokens=max_tokens, default_max_tokens=state.max_len, prompt_len=len(ids),
            max_len=state.max_len, max_n=state.config.max_n, logprobs=lp, vocab_size=state.text.vocab_size,
            max_tokens_param="max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens",
        )
        rf = grammar_spec(req)
        rid = new_id("chatcmpl")
        parts = [EnginePart(rid, ids, params, rf)]
        return await _generate(state, request, "chat", req, parts, stops, arrival, rid)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        arrival = time.monotonic()
        req: CompletionRequest = parse(CompletionRequest, await _read_body(request, state.config.max_body_bytes))
        _check_model(state, req.model)
        if req.suffix:
            raise APIError(400, "'suffix' is not supported by tripod; remove it", param="suffix")
        if req.best_of is not None and req.best_of != (req.n or 1):
            raise APIError(400, "'best_of' is not supported by tripod; remove it or set it equal to 'n'",
                           param="best_of")
        if req.logprobs is not None and not 0 <= req.logprobs <= MAX_TOP_LOGPROBS:
            raise APIError(400, f"'logprobs' must be between 0 and {MAX_TOP_LOGPROBS} (got {req.logprobs})",
                           param="logprobs")
        if req.echo and req.logprobs is not None:
            raise APIError(400, "'echo' with 'logprobs' (prompt logprobs) is not supported by tripod yet",
                           param="echo")
        prompts = _prompt_ids(state, req.prompt)
        rid = new_id("cmpl")
        rf = grammar_spec(req)
        parts = []
        stops: list[str] = []
        for i, ids in enumerate(prompts):
            params, stops = sampling_params(
                req, max_tokens=req.max_tokens, default_max_tokens=COMPLETIONS_DEFAULT_MAX_TOKENS,
                prompt_len=len(ids), max_len=state.max_len, max_n=state.config.max_n,
                logprobs=req.logprobs, vocab_size=state.text.vocab_size,
            )
            parts.append(EnginePart(rid if len(prompts) == 1 else f"{rid}-p{i}", ids, params, rf))
        return await _generate(state, request, "completion", req, parts, stops, arrival, rid)

    return app


def _model_card(state: ServerState) -> dict[str, Any]:
    info = state.client.info
    meta = {
        "dtype": info.dtype if info else None,
        "quantization": state.quantization,
        # "dequantized" (to dtype) or "stored" (GGUF Q4_1/Q8_0 executed as stored; --weights).
        "weights": state.engine_config.weights,
        "architecture": info.architecture if info else None,
        "max_model_len": state.max_len,
        "device": state.engine_config.device,
    }
    # The same facts at the top level (as vLLM puts max_model_len) and under "metadata".
    return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "tripod",
            **meta, "metadata": meta}


def _check_model(state: ServerState, name: str | None) -> None:
    if name is None or name in (state.model_name, "default"):
        return
    raise APIError(404, f"the model {name!r} does not exist; this server serves {state.model_name!r}",
                   param="model", code="model_not_found")


def _check_ids(state: ServerState, ids: list[int], what: str) -> None:
    try:
        state.text.check_ids(ids, what)
    except ValueError as e:
        raise APIError(400, str(e), param=what) from None


def _chat_ids(state: ServerState, messages: Any) -> list[int]:
    msgs = chat_messages(messages)
    try:
        return state.text.chat(msgs)
    except ChatTemplateError as e:
        raise APIError(400, str(e), param="messages") from None


def _prompt_ids(state: ServerState, prompt: Any) -> list[list[int]]:
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
            _check_ids(state, p, "prompt")
            out.append(list(p))
    return out


async def _generate(
    state: ServerState,
    request: Request,
    kind: str,
    req: Any,
    parts: list[EnginePart],
    stops: list[str],
    arrival: float,
    rid: str,
) -> Response:
    cfg = state.config
    if state.draining:
        raise APIError(503, "the server is shutting down; retry on another replica", type="server_error",
                       code="draining", headers={"Retry-After": str(cfg.retry_after)})
    n = parts[0].params["n"]
    try:
        handle = state.client.open(parts, n)
    except Overloaded as e:
        raise APIError(cfg.overload_status, f"the server is at capacity ({e}); retry later",
                       type="server_error", code="overloaded",
                       headers={"Retry-After": str(cfg.retry_after)}) from None
    except EngineDead as e:
        raise APIError(503, f"the engine is not running: {e}", type="server_error", code="engine_dead") from None
    gen = Generation(handle, state.text, stops, state.metrics, arrival)
    handed_off = False
    try:
        it = gen.deltas()
        # The first delta comes before the response starts: a request the engine refuses still
        # gets its 4xx status, and a client gone during prefill is noticed.
        first = await _until_disconnect(request, anext(it, None))
        created = int(time.time())
        echo = [state.text.decode(p.prompt_ids) for p in parts] if getattr(req, "echo", False) else None
        if req.stream:
            body = _stream_body(state, kind, req, gen, it, first, rid, created, echo)
            handed_off = True
            return ClosingStream(body, on_close=handle.close, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
        c = await _until_disconnect(request, collect(gen, it, first))
        gen.done()
        choices = []
        lp_builder: CompletionLogprobs | None = None
        for idx in sorted(c.texts):
            text = "".join(c.texts[idx])
            if kind == "chat":
                choices.append({
                    "index": idx,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": {"content": chat_logprobs(state.text, c.logprobs[idx])} if req.logprobs else None,
                    "finish_reason": c.finish[idx],
                })
            else:
                prefix = echo[idx // n] if echo else ""
                lps = None
                if req.logprobs is not None:
                    lp_builder = CompletionLogprobs(state.text, len(prefix))
                    lps = lp_builder.body(c.logprobs[idx])
                choices.append({"index": idx, "text": prefix + text, "logprobs": lps, "finish_reason": c.finish[idx]})
        return JSONResponse({
            "id": rid,
            "object": "chat.completion" if kind == "chat" else "text_completion",
            "created": created,
            "model": state.model_name,
            "choices": choices,
            "usage": gen.usage.body(),
            "system_fingerprint": _fingerprint(state),
        })
    finally:
        if not handed_off:
            handle.close()


def _fingerprint(state: ServerState) -> str:
    info = state.client.info
    return f"tripod-{info.dtype if info else '?'}-{state.quantization}"


async def _stream_body(
    state: ServerState,
    kind: str,
    req: Any,
    gen: Generation,
    it: AsyncIterator[Delta],
    first: Delta | None,
    rid: str,
    created: int,
    echo: list[str] | None,
) -> AsyncIterator[bytes]:
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    fp = _fingerprint(state)
    n = gen.handle.n
    lp_builders: dict[int, CompletionLogprobs] = {}

    def chunk(choices: list[dict[str, Any]]) -> bytes:
        body: dict[str, Any] = {
            "id": rid, "object": obj, "created": created, "model": state.model_name,
            "system_fingerprint": fp, "choices": choices,
        }
        if include_usage:
            body["usage"] = None
        return sse(body)

    def choice(d: Delta) -> dict[str, Any]:
        if kind == "chat":
            delta: dict[str, Any] = {"content": d.text} if d.text or d.finish_reason is None else {}
            return {
                "index": d.index, "delta": delta,
                "logprobs": {"content": chat_logprobs(state.text, d.logprobs)} if req.logprobs else None,
                "finish_reason": d.finish_reason,
            }
        lps = None
        if req.logprobs is not None:
            b = lp_builders.setdefault(d.index, CompletionLogprobs(state.text, 0))
            lps = b.body(d.logprobs)
        return {"index": d.index, "text": d.text, "logprobs": lps, "finish_reason": d.finish_reason}

    try:
        indices = sorted(s.index for s in gen.seqs.values())
        if kind == "chat":
            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None} for i in indices])
        elif echo:
            yield chunk([{"index": i, "text": echo[i // n], "logprobs": None, "finish_reason": None}
                         for i in indices])
        if first is not None:
            yield chunk([choice(first)])
        async for d in it:
            yield chunk([choice(d)])
        gen.done()
        if include_usage:
            yield sse({
                "id": rid, "object": obj, "created": created, "model": state.model_name,
                "system_fingerprint": fp, "choices": [], "usage": gen.usage.body(),
            })
    except APIError as e:
        # The status line is gone already; the error travels as an event, as OpenAI does.
        yield sse(e.body())
    yield SSE_DONE


@contextlib.asynccontextmanager
async def lifespan_for(state: ServerState) -> AsyncIterator[None]:
    """Start the engine process before the port opens; stop it after the last answer."""
    info = await state.client.start()
    log.info(
        "engine ready: %s (%s, weights %s, dtype %s), context %d, pid %d",
        state.model_name, info.architecture, state.quantization, info.dtype, info.max_request_len, info.pid,
    )
    cfg = state.config
    log.info("serving the OpenAI API at http://%s:%d/v1%s", cfg.host, cfg.port,
             " (API key required)" if cfg.api_key else "")
    try:
        yield
    finally:
        await state.client.stop()

