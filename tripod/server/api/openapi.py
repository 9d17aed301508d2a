"""The HTTP API's OpenAPI document, served at ``/openapi.json``.

Request bodies are described by the very pydantic models the routes parse them with (so the
document cannot drift from what is accepted), and every error by the shape it is answered in:
OpenAI's ``{"error": {message, type, param, code}}``, Anthropic's ``{"type": "error", "error":
{type, message}}`` on ``/v1/messages``. ``tests/server/test_api_fuzz.py`` fuzzes the server from it.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from tripod import __version__
from tripod.server.api.admin import DetokenizeRequest, TokenizeRequest, add_admin_routes
from tripod.server.api.anthropic import add_anthropic_routes
from tripod.server.api.anthropic_requests import CountTokensRequest, MessagesRequest
from tripod.server.api.embeddings import (
    EmbeddingsRequest,
    RerankRequest,
    ScoreRequest,
    add_embedding_routes,
)
from tripod.server.api.openai import add_openai_routes
from tripod.server.api.openai_requests import ChatCompletionRequest, CompletionRequest
from tripod.server.api.responses import add_responses_routes
from tripod.server.api.responses_requests import ResponsesRequest

OPENAI_ERROR: dict[str, Any] = {
    "type": "object", "required": ["error"], "additionalProperties": False,
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"], "additionalProperties": False,
        "properties": {"message": {"type": "string", "minLength": 1}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
}
ANTHROPIC_ERROR: dict[str, Any] = {
    "type": "object", "required": ["type", "error"], "additionalProperties": False,
    "properties": {"type": {"const": "error"}, "error": {
        "type": "object", "required": ["type", "message"], "additionalProperties": False,
        "properties": {"type": {"type": "string"}, "message": {"type": "string", "minLength": 1}}}},
}
_OBJECT: dict[str, Any] = {"type": "object"}
# A model card's fields a client decides on (the card has more: dtype, compute, tool calling, ...).
MODEL_CARD: dict[str, Any] = {"type": "object", "required": ["id", "modalities"], "properties": {
    "id": {"type": "string"}, "max_model_len": {"type": "integer"},
    "modalities": {"type": "array", "items": {"enum": ["text", "image"]}, "description": "what the model reads: "
                   "[\"text\"], or [\"text\", \"image\"] for a vision-language model (image content parts)"}}}
MODEL_LIST: dict[str, Any] = {"type": "object", "required": ["data"], "properties": {
    "data": {"type": "array", "items": {"$ref": "#/components/schemas/ModelCard"}}}}

# path → (request model, answers may stream, the error shape)
_BODIES: dict[str, tuple[type[BaseModel], bool, str]] = {
    "/v1/chat/completions": (ChatCompletionRequest, True, "OpenAIError"),
    "/v1/completions": (CompletionRequest, True, "OpenAIError"),
    "/v1/messages": (MessagesRequest, True, "AnthropicError"),
    "/v1/messages/count_tokens": (CountTokensRequest, False, "AnthropicError"),
    "/v1/responses": (ResponsesRequest, True, "OpenAIError"),
    "/v1/embeddings": (EmbeddingsRequest, False, "OpenAIError"),
    "/v1/rerank": (RerankRequest, False, "OpenAIError"),
    "/rerank": (RerankRequest, False, "OpenAIError"),
    "/v2/rerank": (RerankRequest, False, "OpenAIError"),
    "/v1/score": (ScoreRequest, False, "OpenAIError"),
    "/tokenize": (TokenizeRequest, False, "OpenAIError"),
    "/detokenize": (DetokenizeRequest, False, "OpenAIError"),
}


def _errors(shape: str) -> dict[str, Any]:
    ref = {"$ref": f"#/components/schemas/{shape}"}
    return {code: {"description": "an error, in the API's own shape", "content": {"application/json": {"schema": ref}}}
            for code in ("4XX", "5XX")}


def api_document() -> dict[str, Any]:
    """The document without a running server (the routes only close over the state they serve)."""
    app = FastAPI()
    unused: Any = None
    add_admin_routes(app, unused)
    add_openai_routes(app, unused)
    add_anthropic_routes(app, unused)
    add_responses_routes(app, unused)
    add_embedding_routes(app, unused)
    return openapi_document(app)


def openapi_document(app: FastAPI) -> dict[str, Any]:
    doc = get_openapi(title="tripod", version=__version__, routes=app.routes,
                      description="tripod's OpenAI-compatible and Anthropic-compatible API")
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    schemas.pop("HTTPValidationError", None)  # FastAPI's own 422 shape: tripod answers 400 in its own
    schemas.pop("ValidationError", None)
    schemas["OpenAIError"] = OPENAI_ERROR
    schemas["AnthropicError"] = ANTHROPIC_ERROR
    schemas["ModelCard"], schemas["ModelList"] = MODEL_CARD, MODEL_LIST
    for path, item in doc["paths"].items():
        for method, op in item.items():
            op.pop("requestBody", None)
            shape = "AnthropicError" if path.startswith("/v1/messages") else "OpenAIError"
            ok: dict[str, Any] = {"application/json": {"schema": _OBJECT}}
            if path == "/metrics":
                ok = {"text/plain": {"schema": {"type": "string"}}}
            elif path.startswith("/v1/models"):
                card = "ModelList" if path == "/v1/models" else "ModelCard"
                ok = {"application/json": {"schema": {"$ref": f"#/components/schemas/{card}"}}}
            op["responses"] = {"200": {"description": "the answer", "content": ok}, **_errors(shape)}
            if path == "/health":  # 503 while draining or with the engine dead: a status object
                op["responses"]["503"] = {"description": "not serving", "content": {"application/json": {
                    "schema": {"type": "object", "required": ["status"]}}}}
            if method != "post" or path not in _BODIES:
                continue
            model, streams, shape = _BODIES[path]
            schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(schema.pop("$defs", {}))
            schemas[model.__name__] = schema
            op["requestBody"] = {"required": True, "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
            if streams:  # "stream": true answers with server-sent events (JSON chunks, then [DONE])
                op["responses"]["200"]["content"]["text/event-stream"] = {"schema": {}}
            op["responses"].update(_errors(shape))
    return doc
