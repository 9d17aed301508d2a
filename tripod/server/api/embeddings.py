"""The retrieval surface: ``POST /v1/embeddings``, ``POST /v1/rerank`` (also ``/rerank`` and
``/v2/rerank``: the Cohere/Jina body) and ``POST /v1/score``.

Each body is parsed and checked as OpenAI's (or Cohere's) API does, so a malformed request gets a
400 naming its parameter. A server of a generative model does not pool: embeddings need an encoder
(``tripod.models.bert``) or a decoder served to pool, rerank and score a cross-encoder; until this
server serves one, each route answers 400 saying what is needed (``code: model_not_embedding``)
rather than a 404 or an answer it cannot stand behind. A server of an encoder
(``tripod serve --model all-minilm-l6-v2``) answers ``/v1/embeddings``: its engine process pools
(``engine/encoder_loop.py``), every request's inputs batched with the others waiting; so does a
server of a decoder started with ``--task embed`` (``engine/pooling.py``: each input a prefill of the
decoder's scheduler, its final hidden states pooled).
"""

from __future__ import annotations

import base64
import math
import struct
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tripod.protocol.engine_ipc import CROSS_ENCODER_ARCHITECTURE, ENCODER_ARCHITECTURE
from tripod.server.answer.generation import new_id
from tripod.server.api.admission import AdmissionCounted, admit_counts
from tripod.server.api.body import StrictModel, parse, read_body
from tripod.server.engine_client import EngineDead
from tripod.server.errors import APIError
from tripod.server.state import ServerState, check_ids, check_model
from tripod.tenants import COUNT_HEADER, RequestRecord, TokenCounts, record_of

MAX_INPUTS = 2048  # OpenAI's cap on inputs per embeddings request


class EmbeddingsRequest(StrictModel):
    """``POST /v1/embeddings`` (OpenAI's fields)."""

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: str = "float"
    dimensions: int | None = None
    user: str | None = None


class RerankRequest(StrictModel):
    """``POST /v1/rerank`` (Cohere's and Jina's body)."""

    model: str | None = None
    query: str
    documents: list[str]
    top_n: int | None = None
    return_documents: bool = False


class ScoreRequest(StrictModel):
    """``POST /v1/score``: ``text_1`` against each of ``text_2`` (or pairwise, equal lengths)."""

    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]


def check_embeddings(req: EmbeddingsRequest) -> list[str | list[int]]:
    """The request's checks; returns its inputs (strings or token lists)."""
    raw = req.input
    inputs: list[str | list[int]] = [raw] if isinstance(raw, str) or (raw and isinstance(raw[0], int)) else list(raw)  # type: ignore[list-item]
    if not inputs or any(len(x) == 0 for x in inputs):
        raise APIError(400, "'input' must not be empty (nor hold an empty string or token list)", param="input")
    if len(inputs) > MAX_INPUTS:
        raise APIError(400, f"'input' may hold at most {MAX_INPUTS} inputs (got {len(inputs)})", param="input")
    if req.encoding_format not in ("float", "base64"):
        raise APIError(400, f"'encoding_format' must be 'float' or 'base64' (got {req.encoding_format!r})",
                       param="encoding_format")
    if req.dimensions is not None and req.dimensions < 1:
        raise APIError(400, f"'dimensions' must be >= 1 (got {req.dimensions})", param="dimensions")
    return inputs


def _vector(v: list[float], dimensions: int | None, fmt: str) -> list[float] | str:
    """One embedding as the answer carries it: cut to ``dimensions`` and renormalised (Matryoshka),
    as floats or as base64 of little-endian float32 (OpenAI's ``base64``)."""
    if dimensions is not None:
        v = v[:dimensions]
        norm = math.sqrt(sum(x * x for x in v)) or 1.0
        v = [x / norm for x in v]
    if fmt == "base64":
        return base64.b64encode(struct.pack(f"<{len(v)}f", *v)).decode()
    return v


async def _run(state: ServerState, ids: list[list[int]], types: list[list[int]] | None = None) -> list[list[float]]:
    """``ids`` through the encoder engine (``types``: pairs for a cross-encoder)."""
    try:
        out = await state.client.embed(new_id("embd"), ids, types)
    except EngineDead as e:
        raise APIError(503, f"the engine is not running: {e}", type="server_error", code="engine_dead") from None
    if out.error is not None:
        raise APIError(400, out.error, param="input")
    return out.vectors


def _pairs(state: ServerState, first: list[str], second: list[str], param: str) -> tuple[list[list[int]], list[list[int]]]:
    """Text pairs → the cross-encoder's ids and token types (its tokenizer's pair encoding)."""
    info = state.client.info
    assert info is not None
    ids, types = [], []
    for i, (a, b) in enumerate(zip(first, second, strict=True)):
        enc = state.text.tokenizer(a, b)
        if len(enc["input_ids"]) > info.max_request_len:
            raise APIError(400, f"{param}[{i}] with its query has {len(enc['input_ids'])} tokens; this model takes "
                           f"at most {info.max_request_len}: shorten it", param=param, code="context_length_exceeded")
        ids.append(list(enc["input_ids"]))
        types.append(list(enc.get("token_type_ids") or [0] * len(enc["input_ids"])))
    return ids, types


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


async def _scores(state: ServerState, request: Request, first: list[str], second: list[str],
                  param: str) -> tuple[list[float], int]:
    """Relevance in [0, 1] per pair (the logit's sigmoid, as sentence-transformers' CrossEncoder
    gives for one label), and the tokens read."""
    ids, types = _pairs(state, first, second, param)
    rec = _admit(state, request, ids, param)
    scores = [_sigmoid(v[0]) for v in await _run(state, ids, types)]
    tokens = sum(len(x) for x in ids)
    _served(state, rec, tokens)
    return scores, tokens


def _admit(state: ServerState, request: Request, ids: list[list[int]], param: str) -> RequestRecord | None:
    """The inputs' tokens against the tenant's token limits, as a chat prompt's (``input_tokens``
    and ``max_context``; nothing is generated, so no output is reserved); a router's count
    request (``COUNT_HEADER``) gets the counts instead."""
    counts = TokenCounts(input_tokens=sum(len(x) for x in ids), output_tokens=0,
                         context_tokens=max(len(x) for x in ids))
    if request.headers.get(COUNT_HEADER) == "count":
        raise AdmissionCounted(counts, record_of(request.scope))
    return admit_counts(state, request, counts, ids, param=param)


def _served(state: ServerState, rec: RequestRecord | None, tokens: int) -> None:
    """Count a served request's input tokens as prompt tokens (``/metrics``, the tenant's record)."""
    state.metrics.on_prompt(tokens, 0)
    if rec is not None:
        rec.prompt_tokens = tokens


async def _embed(state: ServerState, request: Request, req: EmbeddingsRequest,
                 inputs: list[str | list[int]]) -> JSONResponse:
    info = state.client.info
    assert info is not None
    ids: list[list[int]] = []
    for i, x in enumerate(inputs):
        toks = state.text.encode(x) if isinstance(x, str) else list(x)
        if not isinstance(x, str):
            check_ids(state, toks, "input")
        if len(toks) > info.max_request_len:
            raise APIError(400, f"input[{i}] has {len(toks)} tokens; this model takes at most "
                           f"{info.max_request_len}: shorten it", param="input", code="context_length_exceeded")
        ids.append(toks)
    rec = _admit(state, request, ids, "input")
    vectors = await _run(state, ids)
    width = len(vectors[0])
    if req.dimensions is not None and req.dimensions > width:
        raise APIError(400, f"'dimensions' is {req.dimensions} but this model's embeddings have {width}",
                       param="dimensions")
    tokens = sum(len(x) for x in ids)
    _served(state, rec, tokens)
    return JSONResponse({"object": "list", "model": state.model_name, "usage": {"prompt_tokens": tokens,
                                                                                 "total_tokens": tokens},
                         "data": [{"object": "embedding", "index": i,
                                   "embedding": _vector(v, req.dimensions, req.encoding_format)}
                                  for i, v in enumerate(vectors)]})


def _not_pooling(state: ServerState, what: str, needs: str) -> APIError:
    kind = {ENCODER_ARCHITECTURE: "an embedding model", CROSS_ENCODER_ARCHITECTURE: "a cross-encoder"}.get(
        state.architecture or "", "a generative model, which it does not pool (a decoder pools when served with "
        "--task embed)")
    return APIError(400, f"{what} needs {needs}; this server serves {state.model_name!r}, {kind}. Serve one "
                    "for it (e.g. a second tripod serve)", param="model", code="model_not_embedding")


def add_embedding_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        req: EmbeddingsRequest = parse(EmbeddingsRequest, await read_body(request, state.config.max_body_bytes))
        check_model(state, req.model, request)
        inputs = check_embeddings(req)
        if state.architecture == ENCODER_ARCHITECTURE or state.engine_config.task == "embed":
            return await _embed(state, request, req, inputs)
        raise _not_pooling(state, "/v1/embeddings", "an embedding model (an encoder, or a decoder served with "
                           "--task embed, which pools its hidden states)")

    async def rerank(request: Request) -> Response:
        req: RerankRequest = parse(RerankRequest, await read_body(request, state.config.max_body_bytes))
        check_model(state, req.model, request)
        if not req.documents:
            raise APIError(400, "'documents' must hold at least one document", param="documents")
        if req.top_n is not None and req.top_n < 1:
            raise APIError(400, f"'top_n' must be >= 1 (got {req.top_n})", param="top_n")
        if state.architecture != CROSS_ENCODER_ARCHITECTURE:
            raise _not_pooling(state, request.url.path, "a cross-encoder (BertForSequenceClassification)")
        scores, tokens = await _scores(state, request, [req.query] * len(req.documents), req.documents, "documents")
        order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))[: req.top_n or len(scores)]
        return JSONResponse({"id": new_id("rerank"), "model": state.model_name, "usage": {"total_tokens": tokens},
                             "results": [{"index": i, "relevance_score": scores[i],
                                          **({"document": {"text": req.documents[i]}} if req.return_documents else {})}
                                         for i in order]})

    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        app.add_api_route(path, rerank, methods=["POST"])

    @app.post("/v1/score")
    async def score(request: Request) -> Response:
        req: ScoreRequest = parse(ScoreRequest, await read_body(request, state.config.max_body_bytes))
        check_model(state, req.model, request)
        one, two = ([t] if isinstance(t, str) else t for t in (req.text_1, req.text_2))
        if not one or not two:
            raise APIError(400, "'text_1' and 'text_2' must not be empty", param="text_1" if not one else "text_2")
        if len(one) > 1 and len(one) != len(two):
            raise APIError(400, f"'text_1' has {len(one)} texts and 'text_2' {len(two)}: give one text_1, or as "
                           "many as text_2", param="text_2")
        if state.architecture != CROSS_ENCODER_ARCHITECTURE:
            raise _not_pooling(state, "/v1/score", "a cross-encoder (BertForSequenceClassification)")
        scores, tokens = await _scores(state, request, one * len(two) if len(one) == 1 else one, two, "text_2")
        return JSONResponse({"id": new_id("score"), "object": "list", "created": int(time.time()),
                             "model": state.model_name, "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                             "data": [{"index": i, "object": "score", "score": v} for i, v in enumerate(scores)]})
