"""The admin surface: ``/health``, ``/metrics``, ``/v1/models``, ``/tokenize``, ``/detokenize``,
``/debug/engine``, and the request models of ``/tokenize`` and ``/detokenize`` (vLLM's bodies)."""

from __future__ import annotations

import socket
from datetime import UTC, datetime
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tripod.protocol import health
from tripod.server.api.body import StrictModel, parse, read_body
from tripod.server.api.lora import adapter_cards, add_lora_routes
from tripod.server.api.openai_requests import ChatMessage, chat_messages
from tripod.server.engine_client import EngineDead
from tripod.server.errors import APIError
from tripod.server.media.prompt import render_prompt
from tripod.server.state import ServerState, check_ids, check_model


# NOTE: no docstrings on these two: a docstring becomes the schema's description in /openapi.json.
class TokenizeRequest(StrictModel):  # POST /tokenize: a prompt, or chat messages rendered with the template
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(StrictModel):  # POST /detokenize
    model: str | None = None
    tokens: list[int]


def model_card(state: ServerState) -> dict[str, Any]:
    info = state.client.info
    meta = {
        "dtype": info.dtype if info else None,
        # What computes: {"backend": "cpu", "isa": "avx2"} (tripod's kernels of that ISA level), or
        # "reference"/"torch" with the reason the kernels do not run; the latest heartbeat's.
        "compute": compute_card(state),
        # The format as stored, e.g. "awq (int4, group 128, zero points)" (docs/quantized.md).
        "quantization": state.quantization,
        # The same, structured: {"format", "bits", "group_size" (-1: per output channel), "activations"
        # (W8A8: how they are quantized), "computed_by"}; null for an unquantized checkpoint.
        "quantization_detail": info.quantization_detail if info else None,
        # "dequantized" (to dtype), "stored" (GGUF Q4_0/Q4_1/Q8_0/Q5_0/Q4_K/Q6_K, or AWQ/GPTQ/compressed-tensors
        # int4 / int8 codes, executed as stored) or "fp8" (a
        # block-wise FP8 checkpoint kept in FP8, w8a16); --weights.
        "weights": state.engine_config.weights,
        # --enable-rl-api: how many times the weights were replaced in place (server/api/rl.py).
        **({"weight_version": state.client.rl.weight_version} if state.config.enable_rl_api else {}),
        # Speculative decoding (lossless; --speculative): the method (null: off) and its settings.
        "speculative": speculative_card(state),
        "architecture": info.architecture if info else None,
        "max_model_len": state.max_len,
        "device": state.engine_config.device,
        # How tools reach the model: its chat template's own rendering, or tripod's generic
        # prompt format (templates without tools); and the syntax calls are parsed in.
        "tool_calling": state.chat.describe(),
        # How the thinking is split from the answer (reasoning_content, thinking blocks): the
        # parser's name, or null (answers unchanged); --reasoning-parser.
        "reasoning_parser": state.reasoning.name if state.reasoning is not None else None,
        # What the model reads: ["text"], or ["text", "image"] for a vision-language model (docs/serving.md "Vision").
        "modalities": state.modalities,
    }
    # The same facts at the top level (as vLLM puts max_model_len) and under "metadata".
    created_at = datetime.fromtimestamp(state.created, UTC).isoformat().replace("+00:00", "Z")
    # OpenAI's fields (id, object, created, owned_by) and Anthropic's (type, display_name, created_at).
    return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "tripod",
            "type": "model", "display_name": state.model_name, "created_at": created_at, **meta, "metadata": meta}


def compute_card(state: ServerState) -> dict[str, Any] | None:
    """The latest heartbeat's compute card (the kernels may load after start-up), else Ready's."""
    stats, info = state.client.stats, state.client.info
    card = (stats.compute_card if stats is not None else None) or (info.compute if info else None)
    return card.as_json() if card is not None else None


def speculative_card(state: ServerState) -> dict[str, Any]:
    cfg = state.engine_config
    return {"method": cfg.speculative, "num_draft_tokens": cfg.num_draft_tokens if cfg.speculative else None,
            "max_batch": cfg.spec_max_batch if cfg.speculative else None,
            # Grammar-forced text verified in one pass (structured outputs; --no-jump-forward).
            "jump_forward": cfg.jump_forward}


def add_admin_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health")
    async def health() -> JSONResponse:
        return health_answer(state)

    @app.get("/metrics")
    async def metrics() -> Response:
        state.metrics.engine_alive.set(1 if state.client.alive else 0)
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        card = model_card(state)
        cards = [card, *adapter_cards(state, card)]  # the base, then its LoRA adapters
        # Anthropic's list shape (data, first_id, last_id, has_more) beside OpenAI's (object, data).
        return JSONResponse({"object": "list", "data": cards, "first_id": cards[0]["id"], "last_id": cards[-1]["id"],
                             "has_more": False})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> JSONResponse:
        check_model(state, model_id)
        card = model_card(state)
        return JSONResponse(next((c for c in adapter_cards(state, card) if c["id"] == model_id), card))

    @app.get("/debug/engine")
    async def debug_engine() -> JSONResponse:
        """The engine's own accounting (KV slots, queues; the KV invariant when idle)."""
        try:
            stats = await state.client.engine_stats()
        except EngineDead as e:
            raise APIError(503, str(e), type="server_error", code="engine_dead") from None
        return JSONResponse({**stats.as_json(), "inflight": state.client.inflight})

    add_token_routes(app, state)
    add_lora_routes(app, state)


def health_answer(state: ServerState) -> Response:
    c = state.client
    if not c.alive:
        return _health(health.Unhealthy(status="dead", reason=c.dead_reason), 503)
    if state.draining:
        return _health(health.Unhealthy(status="draining"), 503)
    tier = c.info.kv_tier if c.info is not None else None
    return _health(health.Healthy(model=state.model_name, engine_pid=c.pid, running=c.stats.running if c.stats else 0,
                                  waiting=c.stats.waiting if c.stats else 0, role=state.config.role,
                                  kv_tier=f"{socket.gethostname()}:{tier.dir}" if tier is not None else None), 200)


def _health(answer: health.Healthy | health.Unhealthy, status: int) -> Response:
    return Response(health.encode(answer), status_code=status, media_type="application/json")


def add_token_routes(app: FastAPI, state: ServerState) -> None:
    """``/tokenize`` and ``/detokenize`` (vLLM's), with this server's tokenizer and template."""

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        req: TokenizeRequest = parse(TokenizeRequest, await read_body(request, state.config.max_body_bytes))
        check_model(state, req.model, request)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of 'prompt' or 'messages'")
        if req.messages is not None:
            ids = (await render_prompt(state, chat_messages(req.messages))).ids  # (an image's tokens included)
        else:
            assert req.prompt is not None
            ids = state.text.encode(req.prompt, special=req.add_special_tokens)
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": state.max_len})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        req: DetokenizeRequest = parse(DetokenizeRequest, await read_body(request, state.config.max_body_bytes))
        check_model(state, req.model, request)
        check_ids(state, req.tokens, "tokens")
        return JSONResponse({"prompt": state.text.decode(req.tokens, skip_special_tokens=False)})
