"""Tool calling end to end: a real ``tripod serve`` (the embedded 135M model, whose template has no
tools: the generic prompt format) driven by the official ``openai`` client. Every ``tool_choice``
mode, streamed and not; every call's arguments validated with ``jsonschema`` against its tool's
schema; a full round trip; logit_bias and echo + logprobs on the wire."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                              "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 40}},
        "required": ["timezone"], "additionalProperties": False}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "The time in a timezone", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What's the weather in Paris?"}]


def _turn(city: str, i: int, temp: int) -> list[dict[str, Any]]:
    return [
        {"role": "user", "content": f"What's the weather in {city}?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": f"call_{i}", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": city, "unit": "celsius"})}}]},
        {"role": "tool", "tool_call_id": f"call_{i}", "content": f"{temp} degrees, sunny"},
        {"role": "assistant", "content": f"It is {temp} degrees and sunny in {city}."},
    ]


# Three earlier turns in which the assistant called the tool: primed so, even the 135M model
# starts a call by itself under tool_choice "auto" (greedy).
PRIMED = [*_turn("Paris", 0, 18), *_turn("Rome", 1, 25), *_turn("Oslo", 2, 5),
          {"role": "user", "content": "What's the weather in London?"}]


@pytest.fixture(scope="module")
def client(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _valid(calls: list[Any]) -> None:
    assert calls
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_")
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


def _streamed(client: openai.OpenAI, **kw: Any) -> tuple[str | None, list[dict[str, Any]], str | None]:
    """Content, calls (rebuilt from the deltas, checking their order) and finish reason."""
    content: str | None = None
    calls: dict[int, dict[str, Any]] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            d = ch.delta
            if d.content:
                content = (content or "") + d.content
            for tc in d.tool_calls or []:
                if tc.index not in calls:
                    # A call's first chunk: id, type and name, with empty arguments.
                    assert tc.id and tc.type == "function" and tc.function and tc.function.name
                    assert tc.function.arguments == ""
                    calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
                else:
                    assert tc.id is None and tc.function is not None and tc.function.name is None
                    calls[tc.index]["arguments"] += tc.function.arguments or ""
            if ch.finish_reason is not None:
                finish = ch.finish_reason
    return content, [calls[i] for i in sorted(calls)], finish


def _same(whole: Any, streamed: list[dict[str, Any]]) -> None:
    assert [(c.function.name, c.function.arguments) for c in whole] == [(c["name"], c["arguments"]) for c in streamed]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}],
                         ids=["required", "named"])
def test_forced_calls_parse_and_validate(client: openai.OpenAI, server: Any, choice: Any) -> None:
    kw: dict[str, Any] = {"model": "default", "messages": ASK, "tools": TOOLS, "tool_choice": choice,
                          "max_tokens": 60, "temperature": 0}
    before = server.engine_stats()["jump_forward_accepted"]
    r = client.chat.completions.create(**kw)
    # Jump-forward verified the call's forced text (its opening, key names) in fewer passes.
    assert server.engine_stats()["jump_forward_accepted"] > before
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls"
    assert ch.message.content is None
    calls = ch.message.tool_calls
    assert calls is not None and len(calls) == 1  # generic prompt format: one call unless asked
    _valid(calls)
    if isinstance(choice, dict):
        assert calls[0].function.name == "get_time"
    content, streamed, finish = _streamed(client, **kw)
    assert content is None and finish == "tool_calls"
    _same(calls, streamed)


@pytest.mark.slow
def test_sampled_calls_always_validate(client: openai.OpenAI) -> None:
    """Even sampled hot (temperature 1.5, 4 copies), a forced call parses and validates."""
    r = client.chat.completions.create(model="default", messages=ASK, tools=TOOLS, tool_choice="required",
                                       max_tokens=80, temperature=1.5, n=4, seed=11)
    for ch in r.choices:
        assert ch.finish_reason == "tool_calls", ch
        _valid(ch.message.tool_calls or [])


def test_parallel_calls(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {"model": "default", "messages": ASK, "tools": TOOLS, "tool_choice": "required",
                          "max_tokens": 64, "temperature": 0, "parallel_tool_calls": True}
    r = client.chat.completions.create(**kw)
    ch = r.choices[0]
    calls = ch.message.tool_calls or []
    assert len(calls) >= 2  # the small model keeps calling when it may
    complete = calls if ch.finish_reason == "tool_calls" else calls[:-1]  # max_tokens may cut the last
    _valid(complete)
    assert len({c.id for c in calls}) == len(calls)
    _, streamed, finish = _streamed(client, **kw)
    assert finish == ch.finish_reason
    _same(calls, streamed)
    one = client.chat.completions.create(**{**kw, "parallel_tool_calls": False})
    assert one.choices[0].finish_reason == "tool_calls" and len(one.choices[0].message.tool_calls or []) == 1


def test_auto_answers_in_text_or_calls(client: openai.OpenAI) -> None:
    # Asked out of the blue, the small model answers in text ...
    r = client.chat.completions.create(model="default", messages=ASK, tools=TOOLS, max_tokens=16, temperature=0)
    ch = r.choices[0]
    assert ch.message.tool_calls is None and ch.message.content and ch.finish_reason in ("stop", "length")
    # ... and after two turns of calling, it starts a call itself: from the trigger on, the call
    # is constrained, so it parses and validates.
    kw: dict[str, Any] = {"model": "default", "messages": PRIMED, "tools": TOOLS, "tool_choice": "auto",
                          "max_tokens": 48, "temperature": 0}
    r = client.chat.completions.create(**kw)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls", ch
    _valid(ch.message.tool_calls or [])
    assert json.loads((ch.message.tool_calls or [])[0].function.arguments)["city"] == "London"
    content, streamed, finish = _streamed(client, **kw)
    assert finish == "tool_calls" and not content
    _same(ch.message.tool_calls, streamed)


def test_none_never_calls(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="default", messages=PRIMED, tools=TOOLS, tool_choice="none",
                                       max_tokens=20, temperature=0)
    ch = r.choices[0]
    assert ch.message.tool_calls is None and ch.finish_reason in ("stop", "length")
    assert ch.message.content  # the model may even write call markup: with "none" it is just text


def test_round_trip(client: openai.OpenAI) -> None:
    """Call, answer with the result, get the reply; the second prompt reuses the first one (and
    the call, re-rendered as the model wrote it) from the prefix cache."""
    first = client.chat.completions.create(model="default", messages=ASK, tools=TOOLS, tool_choice="required",
                                           max_tokens=60, temperature=0)
    msg = first.choices[0].message
    assert msg.tool_calls
    call = msg.tool_calls[0]
    history = [*ASK, msg.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"}]
    second = client.chat.completions.create(model="default", messages=history, tools=TOOLS, tool_choice="none",
                                            max_tokens=20, temperature=0)
    assert second.choices[0].message.content
    u1, u2 = first.usage, second.usage
    assert u1 is not None and u2 is not None and u2.prompt_tokens_details is not None
    assert u2.prompt_tokens > u1.prompt_tokens + u1.completion_tokens
    # At least the first prompt and the start of the call: a re-tokenized call may split its
    # text differently from the tokens the model sampled, so the tail may not match.
    assert u2.prompt_tokens_details.cached_tokens >= u1.prompt_tokens + 5


def test_models_says_how_tools_are_rendered(client: openai.OpenAI) -> None:
    card = client.models.list().data[0].model_dump()
    assert card["tool_calling"] == {"parser": "hermes", "prompt_format": "generic", "trigger": "<tool_call>",
                                    "parallel_calls_by_default": False}


def test_logit_bias_and_echo_logprobs_on_the_wire(client: openai.OpenAI, server: Any) -> None:
    prompt = "The capital of France is"
    base = client.completions.create(model="default", prompt=prompt, max_tokens=4, temperature=0, logprobs=1)
    lp = base.choices[0].logprobs
    assert lp is not None and lp.tokens
    tok = httpx.post(f"{server.url}/tokenize", json={"prompt": lp.tokens[0]}).json()["tokens"]
    banned = client.completions.create(model="default", prompt=prompt, max_tokens=4, temperature=0,
                                       logit_bias={str(tok[-1]): -100})
    assert not banned.choices[0].text.startswith(lp.tokens[0])
    # echo + logprobs: the prompt's tokens first (the first with no logprob), then the completion.
    e = client.completions.create(model="default", prompt=prompt, max_tokens=4, temperature=0, logprobs=2, echo=True)
    elp = e.choices[0].logprobs
    assert elp is not None and elp.tokens is not None and elp.token_logprobs is not None
    assert elp.top_logprobs is not None and elp.text_offset is not None
    n_prompt = len(elp.tokens) - 4
    assert e.choices[0].text == prompt + base.choices[0].text
    assert "".join(elp.tokens) == e.choices[0].text
    assert elp.token_logprobs[0] is None and elp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in elp.token_logprobs[1:])
    assert elp.tokens[n_prompt:] == lp.tokens and elp.token_logprobs[n_prompt:] == pytest.approx(lp.token_logprobs, abs=1e-4)
    assert elp.text_offset == [len("".join(elp.tokens[:i])) for i in range(len(elp.tokens))]
    # echo + max_tokens 0 scores a text: its logprobs, nothing generated.
    full = prompt + base.choices[0].text
    sc = client.completions.create(model="default", prompt=full, max_tokens=0, echo=True, logprobs=1)
    slp = sc.choices[0].logprobs
    assert sc.choices[0].text == full and sc.choices[0].finish_reason == "length"
    assert sc.usage is not None and sc.usage.completion_tokens == 0
    assert slp is not None and slp.tokens is not None and slp.token_logprobs is not None
    assert "".join(slp.tokens) == full and slp.token_logprobs[0] is None
    assert slp.token_logprobs[1:n_prompt] == pytest.approx(elp.token_logprobs[1:n_prompt], abs=1e-4)
    # Streamed: the echo chunk carries the prompt's logprobs.
    parts = list(client.completions.create(model="default", prompt=prompt, max_tokens=4, temperature=0,
                                           logprobs=2, echo=True, stream=True))
    first = parts[0].choices[0]
    assert first.text == prompt and first.logprobs is not None and first.logprobs.token_logprobs is not None
    assert first.logprobs.token_logprobs[0] is None
    assert first.logprobs.token_logprobs[1:] == pytest.approx(elp.token_logprobs[1:n_prompt], abs=1e-4)
