"""Send one benchmark request to an OpenAI-compatible server, streamed, and time it."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import httpx

from tripod.bench.datasets import BenchRequest
from tripod.bench.metrics import RequestResult


@dataclass(slots=True)
class Target:
    """A server under test."""

    base_url: str
    label: str
    model: str | None = None
    api_key: str | None = None
    ignore_eos: bool = True  # send ``ignore_eos`` (tripod, vLLM and llama.cpp honour it)
    # What is measured: "auto" (chat for conversations, completions for prompts), "responses"
    # (/v1/responses, its typed event stream) or "embeddings" (/v1/embeddings, whole answers).
    endpoint: str = "auto"


ENDPOINTS = ("auto", "responses", "embeddings")


def _responses_body(target: Target, req: BenchRequest) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {"max_output_tokens": req.max_tokens, "stream": True, "temperature": 0.0, "store": False,
                            "input": req.messages if req.messages is not None else req.prompt}
    if target.model:
        body["model"] = target.model
    if target.ignore_eos:
        body["ignore_eos"] = True
    return "/v1/responses", body


def _embeddings_body(target: Target, req: BenchRequest) -> tuple[str, dict[str, Any]]:
    text = req.prompt if req.prompt is not None else "\n".join(str(m.get("content", "")) for m in req.messages or [])
    body: dict[str, Any] = {"input": text}
    if target.model:
        body["model"] = target.model
    return "/v1/embeddings", body


def request_body(target: Target, req: BenchRequest) -> tuple[str, dict[str, Any]]:
    """The path and the streamed, greedy body of ``req`` for ``target``."""
    if target.endpoint == "responses":
        return _responses_body(target, req)
    if target.endpoint == "embeddings":
        return _embeddings_body(target, req)
    body: dict[str, Any] = {"max_tokens": req.max_tokens, "stream": True, "temperature": 0.0,
                            "stream_options": {"include_usage": True}, **req.extra}
    if target.model:
        body["model"] = target.model
    # A dataset whose answers end by themselves (copy, structured) says so in ``extra``.
    if target.ignore_eos and "response_format" not in req.extra and "ignore_eos" not in req.extra:
        body["ignore_eos"] = True
    if req.prompt_ids is not None:  # a conversation kept as tokens: ask for the answer's ids too
        path, body["prompt"], body["return_token_ids"] = "/v1/completions", req.prompt_ids, True
        # (llama.cpp's names for the same, its chunks' ``__verbose.tokens``; other servers ignore them)
        body["return_tokens"] = body["verbose"] = True
    elif req.messages is not None:
        path, body["messages"] = "/v1/chat/completions", req.messages
    else:
        path, body["prompt"] = "/v1/completions", req.prompt
    return path, body


def _record_chunk(res: RequestResult, obj: dict[str, Any], now: float, last: float | None,
                  chunks: int) -> tuple[float | None, int]:
    """Time the text pieces of one streamed chunk and take its usage; (last piece's time, pieces so far)."""
    for ch in obj.get("choices") or []:
        if ch.get("token_ids"):
            res.output_ids.extend(int(t) for t in ch["token_ids"])
        piece = ch.get("text") if "text" in ch else (ch.get("delta") or {}).get("content")
        if piece:
            chunks += 1
            if res.ttft is None:
                res.ttft = now - res.start
            elif last is not None:
                res.itl.append(now - last)
            last = now
    verbose = obj.get("__verbose")  # llama.cpp's (``verbose``): a partial chunk's token, or the whole answer's
    if isinstance(verbose, dict) and verbose.get("tokens") and not any(ch.get("token_ids") for ch in obj.get("choices") or []):
        # (a token that ends inside a UTF-8 character gets no chunk: the ids then fall short of the
        # answer's token count, and the next turn is not sent)
        ids = [int(t) for t in verbose["tokens"]]
        res.output_ids = ids if verbose.get("stop") is True else [*res.output_ids, *ids]
    if obj.get("type") == "response.output_text.delta" and obj.get("delta"):  # the Responses API's events
        chunks += 1
        if res.ttft is None:
            res.ttft = now - res.start
        elif last is not None:
            res.itl.append(now - last)
        last = now
    resp = obj.get("response") if obj.get("type") in ("response.completed", "response.incomplete") else None
    if resp and resp.get("usage"):
        u = resp["usage"]
        res.output_tokens, res.prompt_tokens = int(u.get("output_tokens") or 0), int(u.get("input_tokens") or 0)
        res.cached_tokens = int((u.get("input_tokens_details") or {}).get("cached_tokens") or 0)
    usage = obj.get("usage")
    if usage:
        res.output_tokens = int(usage.get("completion_tokens") or 0)
        res.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        details = usage.get("prompt_tokens_details") or {}
        res.cached_tokens = int(details.get("cached_tokens") or 0)
    return last, chunks


async def send(client: httpx.AsyncClient, target: Target, req: BenchRequest, timeout: float) -> RequestResult:
    path, body = request_body(target, req)
    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    res = RequestResult(start=time.perf_counter(), session=req.session, turn=req.turn)
    last = None
    chunks = 0
    if target.endpoint == "embeddings":
        return await _send_whole(client, target, path, body, headers, res, timeout)
    try:
        async with client.stream("POST", target.base_url.rstrip("/") + path, json=body, headers=headers,
                                 timeout=timeout) as r:
            if r.status_code != 200:
                await r.aread()
                res.error = f"http_{r.status_code}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    res.error = "stream_error"
                    return res
                last, chunks = _record_chunk(res, obj, time.perf_counter(), last, chunks)
    except httpx.TimeoutException:
        res.error = "timeout"
        return res
    except httpx.HTTPError:
        res.error = "connection"
        return res
    except json.JSONDecodeError:
        res.error = "bad_stream"
        return res
    res.e2e = (last or time.perf_counter()) - res.start
    if res.output_tokens == 0:
        res.output_tokens = chunks  # a server that does not report usage: one token per chunk
    if res.ttft is None:
        res.error = "no_output"
    return res


async def _send_whole(client: httpx.AsyncClient, target: Target, path: str, body: dict[str, Any],
                      headers: dict[str, str], res: RequestResult, timeout: float) -> RequestResult:
    """A request answered whole (embeddings): its latency is both its TTFT and its end to end."""
    try:
        r = await client.post(target.base_url.rstrip("/") + path, json=body, headers=headers, timeout=timeout)
    except httpx.TimeoutException:
        res.error = "timeout"
        return res
    except httpx.HTTPError:
        res.error = "connection"
        return res
    if r.status_code != 200:
        res.error = f"http_{r.status_code}"
        return res
    res.e2e = res.ttft = time.perf_counter() - res.start
    res.prompt_tokens = int((r.json().get("usage") or {}).get("prompt_tokens") or 0)
    return res


# What a server says about how it computes, per model in GET /v1/models: tripod's ``compute``
# ({"backend": "cpu", "isa": "avx2"} or {"backend": "reference", "reason": ...}), dtype,
# quantization and weights; a peer reports what it has (llama.cpp and vLLM: owned_by).
MODEL_FIELDS = ("compute", "dtype", "quantization", "weights", "owned_by")


async def served_models(client: httpx.AsyncClient, target: Target,
                        timeout: float = 10.0) -> tuple[list[dict[str, Any]] | None, str | None]:
    """The target's models with the fields of :data:`MODEL_FIELDS` it reports, or None and why
    not (a bench run goes on without them)."""
    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    try:
        r = await client.get(target.base_url.rstrip("/") + "/v1/models", headers=headers, timeout=timeout)
    except httpx.TimeoutException:
        return None, "timeout"
    except httpx.HTTPError as e:
        return None, f"connection: {e}" if str(e) else f"connection: {type(e).__name__}"
    if r.status_code != 200:
        return None, f"http_{r.status_code}"
    try:
        data = r.json().get("data")
    except (ValueError, AttributeError):  # not JSON, or JSON but not an object
        return None, "not a JSON object"
    if not isinstance(data, list):
        return None, "no 'data' list"
    models = []
    for m in data:
        if isinstance(m, dict):
            models.append({"id": m.get("id"), **{k: m[k] for k in MODEL_FIELDS if m.get(k) is not None}})
    return models, None
