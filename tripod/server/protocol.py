"""The OpenAI wire protocol: request models (pydantic, strict types) and range checks.

Types are checked by pydantic in strict mode (``"5"`` is not a number, ``true`` is not 1);
ranges and cross-field rules are checked here with messages that say what to change. Unknown
fields are ignored, as OpenAI-compatible servers do, so clients that send newer fields keep working;
known OpenAI features tripod does not implement are refused by name rather than ignored.
"""

from __future__ import annotations

import json
import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

MAX_STOP = 16
MAX_STOP_LEN = 256
MAX_TOP_LOGPROBS = 20


class APIError(Exception):
    """An error the caller can fix (4xx) or that the server reports (5xx), OpenAI-shaped."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        type: str = "invalid_request_error",
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class ContentPart(_Strict):
    type: str
    text: str | None = None


class ChatMessage(_Strict):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class _Sampling(_Strict):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    priority: int = 0
    logit_bias: dict[str, float] | None = None
    user: str | None = None


class StructuredOutputs(_Strict):
    """vLLM's ``structured_outputs`` object (one of its fields)."""

    json_schema: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _Constrained(_Sampling):
    response_format: dict[str, Any] | None = None
    regex: str | None = None
    ebnf: str | None = None
    choice: list[str] | None = None
    structured_outputs: StructuredOutputs | None = None
    # vLLM's older names, accepted so its users can switch unchanged.
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class ChatCompletionRequest(_Constrained):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None


class CompletionRequest(_Constrained):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


def parse(cls: type[_Strict], raw: bytes) -> Any:
    """Bytes → request model, or an ``APIError`` naming the first bad field."""
    if not raw.strip():
        raise APIError(400, "the request body is empty; send a JSON object")
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, not {type(data).__name__}")
    try:
        return cls.model_validate(data, strict=True)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"] if not isinstance(x, str) or not _is_type_tag(x))
        if err["type"] == "missing":
            raise APIError(400, f"'{loc}' is required", param=loc) from None
        got = err.get("input")
        shown = json.dumps(got)[:80] if _jsonable(got) else repr(got)[:80]
        raise APIError(400, f"'{loc}': {err['msg']} (got {shown})", param=loc) from None


def _is_type_tag(x: str) -> bool:
    # pydantic puts union member names into locations ("str", "list[int]", "function-after[...]").
    return x in ("str", "int", "float", "bool") or "[" in x


def _jsonable(x: Any) -> bool:
    try:
        json.dumps(x)
        return True
    except (TypeError, ValueError):
        return False


def sampling_params(
    req: _Sampling,
    *,
    max_tokens: int | None,
    default_max_tokens: int,
    prompt_len: int,
    max_len: int,
    max_n: int,
    logprobs: int | None,
    vocab_size: int,
    max_tokens_param: str = "max_tokens",
) -> tuple[dict[str, Any], list[str]]:
    """Check ranges; return (``SamplingParams`` fields, stop strings)."""

    def bad(param: str, why: str) -> APIError:
        return APIError(400, f"'{param}' {why} (got {getattr(req, param, None)!r})", param=param)

    def num(name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
        v = getattr(req, name)
        if v is None:
            return default
        if not math.isfinite(v) or v < lo or v > hi or (lo_open and v == lo):
            interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
            raise bad(name, f"must be in {interval}")
        return float(v)

    temperature = num("temperature", 1.0, 0.0, 2.0)
    top_p = num("top_p", 1.0, 0.0, 1.0, lo_open=True)
    min_p = num("min_p", 0.0, 0.0, 1.0)
    freq = num("frequency_penalty", 0.0, -2.0, 2.0)
    pres = num("presence_penalty", 0.0, -2.0, 2.0)
    rep = num("repetition_penalty", 1.0, 0.0, 10.0, lo_open=True)
    top_k = -1 if req.top_k is None else req.top_k
    if top_k < -1:
        raise bad("top_k", "must be -1 (disabled) or >= 0")
    if top_k > vocab_size:
        raise bad("top_k", f"must be at most the vocabulary size {vocab_size}")
    n = 1 if req.n is None else req.n
    if not 1 <= n <= max_n:
        raise bad("n", f"must be between 1 and {max_n}")
    if req.seed is not None and not -(2**63) <= req.seed < 2**63:
        raise bad("seed", "must fit in 64 bits")
    if not -(2**31) <= req.priority < 2**31:
        raise bad("priority", "must fit in 32 bits")
    if req.logit_bias:
        raise APIError(400, "'logit_bias' is not supported by tripod; remove it", param="logit_bias")
    stops = _stop_strings(req.stop)
    stop_ids = list(req.stop_token_ids or [])
    bad_id = next((t for t in stop_ids if not 0 <= t < vocab_size), None)
    if bad_id is not None:
        raise bad("stop_token_ids", f"must be token ids in [0, {vocab_size})")
    if req.stream_options is not None and not req.stream:
        raise bad("stream_options", "is only allowed when 'stream' is true")

    room = max_len - prompt_len
    if room < 1:
        raise APIError(
            400,
            f"the prompt has {prompt_len} tokens but this model's context allows at most "
            f"{max_len - 1} prompt tokens ({max_len} in all, with at least one generated); "
            "shorten the prompt",
            param="messages" if isinstance(req, ChatCompletionRequest) else "prompt",
            code="context_length_exceeded",
        )
    if max_tokens is None:
        max_tokens = min(default_max_tokens, room)
    elif max_tokens < 1:
        raise APIError(400, f"'{max_tokens_param}' must be >= 1 (got {max_tokens})", param=max_tokens_param)
    elif max_tokens > room:
        raise APIError(
            400,
            f"'{max_tokens_param}' is {max_tokens} but the prompt has {prompt_len} tokens and the context "
            f"is {max_len}, leaving room for at most {room}; lower {max_tokens_param} or shorten the prompt",
            param=max_tokens_param,
            code="context_length_exceeded",
        )
    params = {
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "min_p": min_p,
        "repetition_penalty": rep,
        "frequency_penalty": freq,
        "presence_penalty": pres,
        "seed": req.seed,
        "logprobs": logprobs,
        "stop_token_ids": stop_ids,
        "ignore_eos": req.ignore_eos,
        "n": n,
        "priority": req.priority,
    }
    return params, stops


def _stop_strings(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop)
    if len(stops) > MAX_STOP:
        raise APIError(400, f"'stop' may hold at most {MAX_STOP} strings (got {len(stops)})", param="stop")
    for s in stops:
        if not s:
            raise APIError(400, "'stop' strings must not be empty", param="stop")
        if len(s) > MAX_STOP_LEN:
            raise APIError(400, f"'stop' strings must be at most {MAX_STOP_LEN} characters", param="stop")
    return stops


ROLES = ("system", "developer", "user", "assistant", "tool")


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template wants them: plain dicts with string content."""
    if not messages:
        raise APIError(400, "'messages' must hold at least one message", param="messages")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if m.role not in ROLES:
            raise APIError(
                400, f"messages[{i}].role {m.role!r} is unknown; use one of {', '.join(ROLES)}",
                param=f"messages.{i}.role",
            )
        content = m.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise APIError(
                        400, f"messages[{i}]: content parts of type {part.type!r} are not supported; "
                        "send text parts only", param=f"messages.{i}.content",
                    )
                texts.append(part.text)
            content = "".join(texts)
        if content is None:
            if m.role != "assistant":
                raise APIError(400, f"messages[{i}].content is required", param=f"messages.{i}.content")
            content = ""
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content}
        if m.name is not None:
            msg["name"] = m.name
        out.append(msg)
    return out


def grammar_spec(req: _Constrained) -> dict[str, str] | None:
    """The request's output constraint as ``{"kind", "value"}`` (``engine.structured.GrammarSpec``),
    from whichever of OpenAI's ``response_format``, tripod's ``regex``/``ebnf``/``choice`` or
    vLLM's ``structured_outputs``/``guided_*`` the request used; None if unconstrained."""
    found: list[tuple[str, str, str]] = []  # (param, kind, value)
    rf = req.response_format
    if rf is not None:
        kind = rf.get("type")
        if kind == "json_object":
            found.append(("response_format", "json", ""))
        elif kind == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict) or not isinstance(js.get("schema"), dict):
                raise APIError(400, "'response_format.json_schema' must be an object with a 'schema' object "
                               "(and optionally 'name' and 'strict')", param="response_format.json_schema")
            found.append(("response_format", "json", json.dumps(js["schema"])))
        elif kind != "text":
            raise APIError(
                400, "'response_format.type' must be 'text', 'json_object' or 'json_schema' "
                f"(got {kind!r})", param="response_format.type",
            )
    so = req.structured_outputs
    candidates: list[tuple[str, str, Any]] = [
        ("regex", "regex", req.regex), ("ebnf", "ebnf", req.ebnf), ("choice", "choice", req.choice),
        ("guided_json", "json", req.guided_json), ("guided_regex", "regex", req.guided_regex),
        ("guided_choice", "choice", req.guided_choice), ("guided_grammar", "ebnf", req.guided_grammar),
    ]
    if so is not None:
        candidates += [
            ("structured_outputs.json", "json", so.json_schema), ("structured_outputs.regex", "regex", so.regex),
            ("structured_outputs.choice", "choice", so.choice), ("structured_outputs.grammar", "ebnf", so.grammar),
            ("structured_outputs.json_object", "json", "" if so.json_object else None),
        ]
    for param, kind, value in candidates:
        if value is None:
            continue
        if kind == "json" and isinstance(value, str) and value:
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise APIError(400, f"'{param}' is not valid JSON: {e}", param=param) from None
        if kind == "json" and not isinstance(value, (dict, str)):
            raise APIError(400, f"'{param}' must be a JSON schema object", param=param)
        if kind == "choice":
            if not value or not all(isinstance(c, str) and c for c in value):
                raise APIError(400, f"'{param}' must be a non-empty list of non-empty strings", param=param)
            value = json.dumps(value, ensure_ascii=False)
        elif kind == "json":
            value = json.dumps(value) if isinstance(value, dict) else value
        elif not value:
            raise APIError(400, f"'{param}' must not be empty", param=param)
        found.append((param, kind, value))
    if len(found) > 1:
        raise APIError(400, f"give one output constraint, not several ({', '.join(p for p, _, _ in found)})",
                       param=found[1][0])
    if not found:
        return None
    _, kind, value = found[0]
    return {"kind": kind, "value": value}


FinishReasonT = Literal["stop", "length"]
