"""Every bad input gets the error body of the API it called (OpenAI's; Anthropic's on
``/v1/messages``), a 4xx saying what to change, and the server lives on."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSG = [{"role": "user", "content": "Hi"}]
LONG = "hello " * 9000  # ~9000 tokens, over the 8192-token context


def chat(**kw: Any) -> dict[str, Any]:
    return {"messages": MSG, "max_tokens": 4, **kw}


def comp(**kw: Any) -> dict[str, Any]:
    return {"prompt": "Hi", "max_tokens": 4, **kw}


# (id, route, body (dict → JSON, bytes → raw), status, param the error names (None: not checked),
#  words the message must contain)
CASES: list[tuple[str, str, Any, int, str | None, tuple[str, ...]]] = [
    ("malformed-json", CHAT, b'{"messages": [', 400, None, ("not valid JSON",)),
    ("not-utf8", CHAT, b'\xff\xfe{"a"', 400, None, ("JSON",)),
    ("empty-body", CHAT, b"", 400, None, ("empty",)),
    ("array-body", CHAT, b"[1, 2]", 400, None, ("object",)),
    ("messages-missing", CHAT, {"max_tokens": 3}, 400, "messages", ("required",)),
    ("messages-wrong-type", CHAT, {"messages": "hello"}, 400, "messages", ()),
    ("messages-empty", CHAT, {"messages": []}, 400, "messages", ("at least one",)),
    ("message-without-role", CHAT, {"messages": [{"content": "x"}]}, 400, "messages.0.role", ("required",)),
    ("unknown-role", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role", ("wizard", "user")),
    ("content-wrong-type", CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages.0.content", ()),
    ("image-part", CHAT, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}, 400,
     "messages.0.content.0.image_url.url", ("takes text only",)),
    ("audio-part", CHAT, {"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}, 400,
     "messages.0.content.0", ("input_audio", "text")),
    ("temperature-negative", CHAT, chat(temperature=-1), 400, "temperature", ("[0, 2]",)),
    ("temperature-absurd", CHAT, chat(temperature=1e9), 400, "temperature", ("[0, 2]",)),
    ("temperature-string", CHAT, chat(temperature="hot"), 400, "temperature", ("number",)),
    ("top-p-zero", CHAT, chat(top_p=0), 400, "top_p", ("(0, 1]",)),
    ("top-p-above-one", CHAT, chat(top_p=1.5), 400, "top_p", ("(0, 1]",)),
    ("top-k-below-minus-one", CHAT, chat(top_k=-2), 400, "top_k", ("-1",)),
    ("min-p-above-one", CHAT, chat(min_p=2), 400, "min_p", ()),
    ("presence-penalty-absurd", CHAT, chat(presence_penalty=5), 400, "presence_penalty", ()),
    ("frequency-penalty-absurd", CHAT, chat(frequency_penalty=-3), 400, "frequency_penalty", ()),
    ("repetition-penalty-zero", CHAT, chat(repetition_penalty=0), 400, "repetition_penalty", ()),
    ("speculative-string", CHAT, chat(speculative="yes"), 400, "speculative", ("boolean",)),
    ("speculative-int", COMP, comp(speculative=1), 400, "speculative", ("boolean",)),
    ("n-zero", CHAT, chat(n=0), 400, "n", ("between 1 and",)),
    ("n-huge", CHAT, chat(n=100000), 400, "n", ("between 1 and",)),
    ("n-float", CHAT, chat(n=1.5), 400, "n", ("integer",)),
    ("max-tokens-zero", CHAT, chat(max_tokens=0), 400, "max_tokens", (">= 1",)),
    ("max-tokens-negative", CHAT, chat(max_tokens=-5), 400, "max_tokens", (">= 1",)),
    ("max-tokens-bool", CHAT, chat(max_tokens=True), 400, "max_tokens", ("integer",)),
    ("max-tokens-beyond-context", CHAT, chat(max_tokens=10**6), 400, "max_tokens", ("context", "8192")),
    ("max-completion-tokens-zero", CHAT, chat(max_completion_tokens=0), 400, "max_completion_tokens", (">= 1",)),
    ("prompt-over-context", CHAT, {"messages": [{"role": "user", "content": LONG}]}, 400, "messages", ("9", "8191")),
    ("top-logprobs-too-many", CHAT, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs", ("20",)),
    ("top-logprobs-negative", CHAT, chat(logprobs=True, top_logprobs=-1), 400, "top_logprobs", ()),
    ("top-logprobs-without-logprobs", CHAT, chat(top_logprobs=2), 400, "top_logprobs", ("logprobs",)),
    ("logprobs-string", CHAT, chat(logprobs="yes"), 400, "logprobs", ("boolean",)),
    ("stop-number", CHAT, chat(stop=5), 400, "stop", ()),
    ("stop-empty-string", CHAT, chat(stop=[""]), 400, "stop", ("empty",)),
    ("stop-too-many", CHAT, chat(stop=[f"s{i}" for i in range(40)]), 400, "stop", ("at most",)),
    ("stop-token-out-of-vocab", CHAT, chat(stop_token_ids=[10**7]), 400, "stop_token_ids", ()),
    ("stream-not-bool", CHAT, chat(stream="yes"), 400, "stream", ()),
    ("stream-options-without-stream", CHAT, chat(stream_options={"include_usage": True}), 400, "stream_options", ()),
    ("seed-string", CHAT, chat(seed="abc"), 400, "seed", ("integer",)),
    ("response-format-unknown", CHAT, chat(response_format={"type": "yaml"}), 400, "response_format.type", ()),
    ("logit-bias-too-big", CHAT, chat(logit_bias={"5": 101}), 400, "logit_bias", ("[-100, 100]",)),
    ("logit-bias-not-an-id", CHAT, chat(logit_bias={"five": 1}), 400, "logit_bias", ("token ids",)),
    ("logit-bias-out-of-vocab", CHAT, chat(logit_bias={"99999999": 1}), 400, "logit_bias", ("token ids",)),
    ("logit-bias-string-value", CHAT, chat(logit_bias={"5": "up"}), 400, "logit_bias.5", ("number",)),
    ("tools-not-a-list", CHAT, chat(tools={"type": "function"}), 400, "tools", ()),
    ("tool-wrong-type", CHAT, chat(tools=[{"type": "retrieval", "function": {"name": "f"}}]), 400, "tools.0.type", ("function",)),
    ("tool-without-name", CHAT, chat(tools=[{"type": "function", "function": {}}]), 400, "tools.0.function.name", ("required",)),
    ("tool-bad-name", CHAT, chat(tools=[{"type": "function", "function": {"name": "no spaces"}}]), 400, "tools.0", ("letters",)),
    ("tool-duplicate", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}] * 2), 400, "tools.1", ("twice",)),
    ("tool-schema-invalid", CHAT, chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "foo"}}}}}], tool_choice="required"), 400, None, ("foo",)),
    ("tool-choice-unknown", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="always"), 400, "tool_choice", ("required",)),
    ("tool-choice-names-missing-tool", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice={"type": "function", "function": {"name": "g"}}), 400, "tool_choice", ("'g'",)),
    ("tool-choice-required-without-tools", CHAT, chat(tool_choice="required"), 400, "tool_choice", ("no tools",)),
    ("tools-with-response-format", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}], response_format={"type": "json_object"}), 400, "tool_choice", ("cannot be combined",)),
    ("tool-message-without-id", CHAT, {"messages": [{"role": "tool", "content": "18 C"}]}, 400, "messages.0.tool_call_id", ("tool_call_id",)),
    ("tool-calls-on-user", CHAT, {"messages": [{"role": "user", "content": "x", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, 400, "messages.0.tool_calls", ("assistant",)),
    ("parallel-tool-calls-string", CHAT, chat(parallel_tool_calls="yes"), 400, "parallel_tool_calls", ("boolean",)),
    ("functions-deprecated", CHAT, chat(functions=[{"name": "f"}]), 400, "functions", ("tools",)),
    ("unknown-model", CHAT, chat(model="gpt-17"), 404, "model", ("gpt-17",)),
    ("schema-invalid", CHAT, chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}), 400, None, ("invalid JSON schema", "foo")),
    ("schema-missing", CHAT, chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), 400, "response_format.json_schema", ("schema",)),
    ("schema-bad-ref", CHAT, chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nowhere"}}}), 400, None, ("nowhere",)),
    ("regex-invalid", CHAT, chat(regex="a(b"), 400, None, ("invalid regex", "parenthesis")),
    ("ebnf-invalid", CHAT, chat(ebnf="root ::= missing_rule"), 400, None, ("invalid grammar", "missing_rule")),
    ("choice-empty", CHAT, chat(choice=[]), 400, "choice", ("non-empty",)),
    ("two-constraints", CHAT, chat(regex="a+", choice=["a"]), 400, "choice", ("one output constraint",)),
    ("vllm-json-not-json", COMP, comp(structured_outputs={"json": "{nope"}), 400, "structured_outputs.json", ("not valid JSON",)),
    ("comp-prompt-missing", COMP, {"max_tokens": 3}, 400, "prompt", ("required",)),
    ("comp-prompt-empty", COMP, {"prompt": ""}, 400, "prompt", ("empty",)),
    ("comp-prompt-empty-list", COMP, {"prompt": []}, 400, "prompt", ("empty",)),
    ("comp-prompt-number", COMP, {"prompt": 123}, 400, "prompt", ()),
    ("comp-token-out-of-vocab", COMP, {"prompt": [1, 10**9]}, 400, "prompt", ("vocabulary",)),
    ("comp-token-negative", COMP, {"prompt": [1, -5]}, 400, "prompt", ("vocabulary",)),
    ("comp-prompt-over-context", COMP, {"prompt": LONG}, 400, "prompt", ("8191",)),
    ("comp-max-tokens-beyond-context", COMP, comp(max_tokens=9000), 400, "max_tokens", ("context",)),
    ("comp-logprobs-too-many", COMP, comp(logprobs=50), 400, "logprobs", ("20",)),
    ("comp-echo-logprobs-too-many", COMP, comp(logprobs=21, echo=True), 400, "logprobs", ("20",)),
    ("comp-temperature-absurd", COMP, comp(temperature=500), 400, "temperature", ()),
    ("comp-unknown-model", COMP, comp(model="nope"), 404, "model", ()),
]


@pytest.fixture(scope="module")
def http(server: Any) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def _check_error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) >= {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and len(err["message"]) > 10
    return dict(err)


@pytest.mark.parametrize(("route", "body", "status", "param", "words"),
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input(http: httpx.Client, route: str, body: Any, status: int, param: str | None,
                   words: tuple[str, ...]) -> None:
    if isinstance(body, bytes):
        r = http.post(route, content=body, headers={"Content-Type": "application/json"})
    else:
        r = http.post(route, json=body)
    err = _check_error(r, status)
    if param is not None:
        assert err["param"] == param, err
    for w in words:
        assert w in err["message"], err


def test_oversized_body_is_413(http: httpx.Client) -> None:
    """Past the default --max-body-bytes (32 MiB: room for inline images); the 413 says how to raise it."""
    big = json.dumps({"messages": [{"role": "user", "content": "x" * (33 * 2**20)}]}).encode()
    err = _check_error(http.post(CHAT, content=big, headers={"Content-Type": "application/json"}), 413)
    assert "--max-body-bytes" in err["message"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: the server counts while reading
        for _ in range(33):
            yield b" " * 2**20

    _check_error(http.post(CHAT, content=chunks(), headers={"Content-Type": "application/json"}), 413)


def test_unknown_route_and_method(http: httpx.Client) -> None:
    _check_error(http.post("/v1/nothing", json={}), 404)
    _check_error(http.get(CHAT), 405)


def test_server_keeps_serving_after_bad_input(http: httpx.Client, server: Any) -> None:
    for _, route, body, *_ in CASES[:12]:
        if isinstance(body, bytes):
            http.post(route, content=body)
        else:
            http.post(route, json=body)
    assert http.get("/health").status_code == 200
    r = http.post(CHAT, json={"messages": MSG, "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    s = server.wait_idle()
    assert s["consistent"] is True


# ---------------------------------------------------------------------- Anthropic's API
MSGS = "/v1/messages"
COUNT = "/v1/messages/count_tokens"
AMSG = [{"role": "user", "content": "Hi"}]
TOOL = {"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}


def am(**kw: Any) -> dict[str, Any]:
    return {"model": "default", "max_tokens": 4, "messages": AMSG, **kw}


# (id, route, body, status, Anthropic error type, words the message must contain)
ANTHROPIC_CASES: list[tuple[str, str, Any, int, str, tuple[str, ...]]] = [
    ("malformed-json", MSGS, b'{"messages": [', 400, "invalid_request_error", ("not valid JSON",)),
    ("empty-body", MSGS, b"", 400, "invalid_request_error", ("empty",)),
    ("array-body", MSGS, b"[1]", 400, "invalid_request_error", ("object",)),
    ("model-missing", MSGS, {"max_tokens": 4, "messages": AMSG}, 400, "invalid_request_error", ("'model' is required",)),
    ("max-tokens-missing", MSGS, {"model": "default", "messages": AMSG}, 400, "invalid_request_error", ("'max_tokens' is required",)),
    ("max-tokens-zero", MSGS, am(max_tokens=0), 400, "invalid_request_error", (">= 1",)),
    ("max-tokens-string", MSGS, am(max_tokens="4"), 400, "invalid_request_error", ("integer",)),
    ("max-tokens-beyond-context", MSGS, am(max_tokens=10**6), 400, "invalid_request_error", ("context", "8192")),
    ("prompt-over-context", MSGS, am(messages=[{"role": "user", "content": LONG}]), 400, "invalid_request_error", ("8191",)),
    ("messages-missing", MSGS, {"model": "default", "max_tokens": 4}, 400, "invalid_request_error", ("'messages' is required",)),
    ("messages-empty", MSGS, am(messages=[]), 400, "invalid_request_error", ("at least one",)),
    ("system-role-in-messages", MSGS, am(messages=[{"role": "system", "content": "x"}]), 400, "invalid_request_error", ("'system'",)),
    ("content-wrong-type", MSGS, am(messages=[{"role": "user", "content": 5}]), 400, "invalid_request_error", ("content",)),
    ("image-block", MSGS, am(messages=[{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]), 400, "invalid_request_error", ("takes text only",)),
    ("image-block-without-source", MSGS, am(messages=[{"role": "user", "content": [{"type": "image"}]}]), 400, "invalid_request_error", ("source is required",)),
    ("text-block-without-text", MSGS, am(messages=[{"role": "user", "content": [{"type": "text"}]}]), 400, "invalid_request_error", ("text",)),
    ("tool-result-from-assistant", MSGS, am(messages=[{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]), 400, "invalid_request_error", ("user messages",)),
    ("tool-use-without-id", MSGS, am(messages=[{"role": "assistant", "content": [{"type": "tool_use", "name": "f", "input": {}}]}]), 400, "invalid_request_error", ("'id'",)),
    ("system-wrong-type", MSGS, am(system=5), 400, "invalid_request_error", ("system",)),
    ("temperature-above-one", MSGS, am(temperature=1.5), 400, "invalid_request_error", ("[0, 1]",)),
    ("temperature-negative", MSGS, am(temperature=-0.5), 400, "invalid_request_error", ("temperature",)),
    ("top-p-zero", MSGS, am(top_p=0), 400, "invalid_request_error", ("(0, 1]",)),
    ("top-k-negative", MSGS, am(top_k=-5), 400, "invalid_request_error", ("top_k",)),
    ("stop-sequences-empty-string", MSGS, am(stop_sequences=[""]), 400, "invalid_request_error", ("empty",)),
    ("stop-sequences-not-list", MSGS, am(stop_sequences="END"), 400, "invalid_request_error", ("stop_sequences",)),
    ("stream-not-bool", MSGS, am(stream="yes"), 400, "invalid_request_error", ("stream",)),
    ("tool-without-schema", MSGS, am(tools=[{"name": "f"}]), 400, "invalid_request_error", ("input_schema",)),
    ("tool-bad-name", MSGS, am(tools=[{**TOOL, "name": "a b"}]), 400, "invalid_request_error", ("letters",)),
    ("server-tool", MSGS, am(tools=[{"type": "web_search_20250305", "name": "web_search"}]), 400, "invalid_request_error", ("web_search_20250305",)),
    ("tool-choice-unknown-type", MSGS, am(tools=[TOOL], tool_choice={"type": "sometimes"}), 400, "invalid_request_error", ("'any'",)),
    ("tool-choice-tool-without-name", MSGS, am(tools=[TOOL], tool_choice={"type": "tool"}), 400, "invalid_request_error", ("name",)),
    ("tool-choice-names-missing-tool", MSGS, am(tools=[TOOL], tool_choice={"type": "tool", "name": "other"}), 400, "invalid_request_error", ("'other'",)),
    ("tool-choice-any-without-tools", MSGS, am(tool_choice={"type": "any"}), 400, "invalid_request_error", ("no tools",)),
    ("tool-schema-invalid", MSGS, am(tools=[{"name": "f", "input_schema": {"type": "object", "properties": {"a": {"type": "foo"}}}}], tool_choice={"type": "any"}), 400, "invalid_request_error", ("foo",)),
    ("only-past-thinking", MSGS, am(messages=[{"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"}]}]), 400, "invalid_request_error", ("nothing to prompt with",)),
    ("thinking-enabled", MSGS, am(thinking={"type": "enabled", "budget_tokens": 1024}), 400, "invalid_request_error", ("thinking",)),
    ("unknown-model", MSGS, am(model="claude-opus-9"), 404, "not_found_error", ("claude-opus-9",)),
    ("count-messages-missing", COUNT, {"model": "default"}, 400, "invalid_request_error", ("'messages' is required",)),
    ("count-image-block", COUNT, {"model": "default", "messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}]}]}, 400, "invalid_request_error", ("takes text only",)),
    ("count-unknown-model", COUNT, {"model": "nope", "messages": AMSG}, 404, "not_found_error", ("nope",)),
    ("unknown-route", "/v1/messages/batches", {}, 404, "not_found_error", ("no such route",)),
]


def _check_anthropic_error(r: httpx.Response, status: int, kind: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    assert set(body["error"]) == {"type", "message"}, body
    assert body["error"]["type"] == kind, body
    msg = body["error"]["message"]
    assert isinstance(msg, str) and len(msg) > 10
    return str(msg)


@pytest.mark.parametrize(("route", "body", "status", "kind", "words"),
                         [c[1:] for c in ANTHROPIC_CASES], ids=[c[0] for c in ANTHROPIC_CASES])
def test_anthropic_bad_input(http: httpx.Client, route: str, body: Any, status: int, kind: str,
                             words: tuple[str, ...]) -> None:
    if isinstance(body, bytes):
        r = http.post(route, content=body, headers={"Content-Type": "application/json"})
    else:
        r = http.post(route, json=body)
    msg = _check_anthropic_error(r, status, kind)
    for w in words:
        assert w in msg, msg


def test_anthropic_oversized_body_and_bad_method(http: httpx.Client) -> None:
    big = json.dumps(am(messages=[{"role": "user", "content": "x" * (33 * 2**20)}])).encode()
    _check_anthropic_error(http.post(MSGS, content=big, headers={"Content-Type": "application/json"}), 413,
                           "request_too_large")
    _check_anthropic_error(http.get(MSGS), 405, "invalid_request_error")
    assert http.get("/health").status_code == 200
