"""The Anthropic Messages API end to end: a real ``tripod serve`` driven by the official
``anthropic`` client. Text, streaming (the event sequence on the wire), system prompts, stop
sequences, tool use and tool results, count_tokens, prefill, and the same answers as the OpenAI
side for the same conversation."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
GREEDY = {"temperature": 0}  # this SDK's create() no longer takes sampling parameters by name
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                              "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS: list[Any] = [{"name": "get_weather", "description": "The current weather in a city", "input_schema": WEATHER}]


@pytest.fixture(scope="module")
def client(server: Any) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def oai(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _text(m: Any) -> str:
    return "".join(b.text for b in m.content if b.type == "text")


def test_text_matches_the_openai_side(client: anthropic.Anthropic, oai: openai.OpenAI) -> None:
    ref = oai.chat.completions.create(model="default", messages=QUESTION, max_tokens=30, temperature=0)
    m = client.messages.create(model="default", max_tokens=30, messages=QUESTION, extra_body=GREEDY)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"]
    assert _text(m) == ref.choices[0].message.content
    assert m.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[ref.choices[0].finish_reason]
    assert m.stop_sequence is None
    assert ref.usage is not None
    u = m.usage
    assert u.output_tokens == ref.usage.completion_tokens
    # Anthropic's accounting: uncached + read from the cache = the whole prompt.
    assert u.input_tokens + (u.cache_read_input_tokens or 0) == ref.usage.prompt_tokens
    assert (u.cache_read_input_tokens or 0) > 0  # the OpenAI call just cached this very prompt
    count = client.messages.count_tokens(model="default", messages=QUESTION)
    assert count.input_tokens == ref.usage.prompt_tokens


def test_stream_agrees_with_whole(client: anthropic.Anthropic) -> None:
    kw: dict[str, Any] = {"model": "default", "max_tokens": 30, "messages": QUESTION, "extra_body": GREEDY}
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert streamed == _text(whole) == _text(final)
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_stream_event_sequence_on_the_wire(server: Any) -> None:
    body = {"model": "default", "max_tokens": 12, "messages": QUESTION, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/messages", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = []
    for block in raw.strip().split("\n\n"):
        name, data = block.split("\n", 1)
        assert name.startswith("event: ") and data.startswith("data: ")
        obj = json.loads(data.removeprefix("data: "))
        assert obj["type"] == name.removeprefix("event: ")
        events.append(obj)
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["message_start", "ping"]
    assert kinds[2] == "content_block_start" and events[2]["content_block"] == {"type": "text", "text": ""}
    assert set(kinds[3:-3]) == {"content_block_delta"}
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert all(e["delta"]["type"] == "text_delta" and e["index"] == 0 for e in events[3:-3])
    start = events[0]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["input_tokens"] > 0
    delta = events[-2]
    assert delta["delta"]["stop_reason"] in ("end_turn", "max_tokens") and delta["usage"]["output_tokens"] > 0


def test_system_as_string_or_blocks(client: anthropic.Anthropic, oai: openai.OpenAI) -> None:
    system = "You are a pirate. Answer like one."
    a = client.messages.create(model="default", max_tokens=20, system=system, messages=QUESTION, extra_body=GREEDY)
    b = client.messages.create(model="default", max_tokens=20, messages=QUESTION, extra_body=GREEDY,
                               system=[{"type": "text", "text": "You are a pirate. "},
                                       {"type": "text", "text": "Answer like one.", "cache_control": {"type": "ephemeral"}}])
    ref = oai.chat.completions.create(model="default", max_tokens=20, temperature=0,
                                      messages=[{"role": "system", "content": system}, *QUESTION])
    assert _text(a) == _text(b) == ref.choices[0].message.content


def test_stop_sequences(client: anthropic.Anthropic) -> None:
    kw: dict[str, Any] = {"model": "default", "max_tokens": 30, "messages": QUESTION, "extra_body": GREEDY}
    full = _text(client.messages.create(**kw))
    assert "Paris" in full, full
    m = client.messages.create(stop_sequences=["Par", "zzz"], **kw)
    assert _text(m) == full[: full.index("Par")]
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "Par"
    with client.messages.stream(stop_sequences=["Par"], **kw) as s:
        assert "".join(s.text_stream) == _text(m)
        final = s.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == "Par"


def test_max_tokens_and_prefill(client: anthropic.Anthropic) -> None:
    m = client.messages.create(model="default", max_tokens=3, messages=QUESTION,
                               extra_body={"temperature": 0, "ignore_eos": True})
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 3
    # A last assistant message is continued (Anthropic's prefill), not answered anew.
    pre = client.messages.create(model="default", max_tokens=8, extra_body=GREEDY, messages=[
        *QUESTION, {"role": "assistant", "content": "The capital of France is"}])
    assert _text(pre).strip().startswith("Paris"), _text(pre)


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}], ids=["any", "tool"])
def test_tool_use(client: anthropic.Anthropic, choice: Any) -> None:
    kw: dict[str, Any] = {"model": "default", "max_tokens": 60, "tools": TOOLS, "tool_choice": choice,
                          "messages": [{"role": "user", "content": "What's the weather in Paris?"}], "extra_body": GREEDY}
    m = client.messages.create(**kw)
    assert m.stop_reason == "tool_use"
    uses = [b for b in m.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather" and uses[0].id.startswith("toolu_")
    jsonschema.validate(uses[0].input, WEATHER)
    # Streamed: input_json_delta pieces that add up to the same input.
    pieces: list[str] = []
    with client.messages.stream(**kw) as s:
        for ev in s:
            if ev.type == "content_block_delta" and ev.delta.type == "input_json_delta":
                pieces.append(ev.delta.partial_json)
        final = s.get_final_message()
    assert len(pieces) > 1
    assert json.loads("".join(pieces)) == uses[0].input
    fuses = [b for b in final.content if b.type == "tool_use"]
    assert final.stop_reason == "tool_use" and [(b.name, b.input) for b in fuses] == [(b.name, b.input) for b in uses]


@pytest.mark.slow
def test_tool_use_sampled_always_validates(client: anthropic.Anthropic) -> None:
    for seed in range(3):
        m = client.messages.create(model="default", max_tokens=80, tools=TOOLS, tool_choice={"type": "any"},
                                   messages=[{"role": "user", "content": "Weather in Rome, please."}],
                                   extra_body={"temperature": 1.0, "seed": seed})
        assert m.stop_reason == "tool_use"
        for b in m.content:
            if b.type == "tool_use":
                jsonschema.validate(b.input, WEATHER)


def test_tool_result_round_trip_and_none(client: anthropic.Anthropic) -> None:
    ask = {"role": "user", "content": "What's the weather in Paris?"}
    first = client.messages.create(model="default", max_tokens=60, tools=TOOLS, tool_choice={"type": "any"},
                                   messages=[ask], extra_body=GREEDY)
    use = next(b for b in first.content if b.type == "tool_use")
    history: list[Any] = [ask, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                          {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                        "content": "18 degrees, sunny"}]}]
    second = client.messages.create(model="default", max_tokens=20, tools=TOOLS, tool_choice={"type": "none"},
                                    messages=history, extra_body=GREEDY)
    assert second.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in second.content] == ["text"] and _text(second)
    # The first request's whole prompt came from the prefix cache: the conversation was rendered
    # the same way, with the call written back as the model wrote it.
    assert (second.usage.cache_read_input_tokens or 0) >= first.usage.input_tokens + (
        first.usage.cache_read_input_tokens or 0) + 5
    n = client.messages.count_tokens(model="default", messages=history, tools=TOOLS)
    assert n.input_tokens == second.usage.input_tokens + (second.usage.cache_read_input_tokens or 0)
    bare = client.messages.count_tokens(model="default", messages=[ask])
    assert bare.input_tokens < client.messages.count_tokens(model="default", messages=[ask], tools=TOOLS).input_tokens


def test_structured_output_format(client: anthropic.Anthropic) -> None:
    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 30}},
              "required": ["capital"], "additionalProperties": False}
    m = client.messages.create(model="default", max_tokens=40, messages=QUESTION, extra_body=GREEDY,
                               output_config={"format": {"type": "json_schema", "schema": schema}})
    jsonschema.validate(json.loads(_text(m)), schema)


def test_models_list_in_anthropic_shape(client: anthropic.Anthropic) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == ["SmolLM2-135M-Instruct"]
    assert models.data[0].type == "model" and models.data[0].display_name
