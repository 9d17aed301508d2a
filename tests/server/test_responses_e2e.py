"""The Responses API end to end: the session's real ``tripod serve`` (embedded SmolLM2, fp32,
memory store) driven by the official ``openai`` client and the OpenAI Agents SDK's default
(Responses) model, unmodified.

Exactness: a greedy ``/v1/responses`` answer equals ``/v1/chat/completions``'s for the same
conversation, a ``previous_response_id`` follow-up equals sending the whole conversation, and a
streamed answer equals the whole one. Errors are 4xx in OpenAI's shape naming the parameter.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
           "required": ["city"], "additionalProperties": False}
TOOL = {"type": "function", "name": "get_weather", "description": "The current weather in a city",
        "parameters": WEATHER, "strict": True}
GREEDY: dict[str, Any] = {"model": "default", "temperature": 0.0}


@pytest.fixture(scope="module")
def client(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _chat(client: openai.OpenAI, messages: list[dict[str, Any]], n: int, **kw: Any) -> Any:
    return client.chat.completions.create(messages=messages, max_tokens=n, **GREEDY, **kw)  # type: ignore[call-overload]


def test_whole_answer_equals_chat_and_is_stored(client: openai.OpenAI) -> None:
    r = client.responses.create(input="Name a fruit.", instructions="Answer in one word.", max_output_tokens=12,
                                **GREEDY)
    chat = _chat(client, [{"role": "system", "content": "Answer in one word."},
                          {"role": "user", "content": "Name a fruit."}], 12)
    assert r.object == "response" and r.id.startswith("resp_") and r.status in ("completed", "incomplete")
    assert r.output_text == chat.choices[0].message.content
    assert r.usage is not None and r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    msg = r.output[0]
    assert msg.type == "message" and msg.role == "assistant" and msg.content[0].type == "output_text"
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text and got.instructions == "Answer in one word."
    items = client.responses.input_items.list(r.id)
    assert [i.type for i in items.data] == ["message"] and items.data[0].content[0].text == "Name a fruit."


def test_follow_up_equals_the_whole_conversation(client: openai.OpenAI) -> None:
    first = client.responses.create(input="My name is Ada. Say hi.", max_output_tokens=12, **GREEDY)
    follow = client.responses.create(input="What is my name?", previous_response_id=first.id,
                                     max_output_tokens=12, **GREEDY)
    whole = client.responses.create(input=[
        {"role": "user", "content": "My name is Ada. Say hi."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"}], max_output_tokens=12, store=False, **GREEDY)
    chat = _chat(client, [{"role": "user", "content": "My name is Ada. Say hi."},
                          {"role": "assistant", "content": first.output_text},
                          {"role": "user", "content": "What is my name?"}], 12)
    assert follow.output_text == whole.output_text == chat.choices[0].message.content
    assert follow.previous_response_id == first.id
    assert follow.usage is not None and whole.usage is not None
    assert follow.usage.input_tokens == whole.usage.input_tokens
    # The follow-up's prompt starts with the first turn's: the prefix cache serves it.
    assert follow.usage.input_tokens_details.cached_tokens > 0
    with pytest.raises(openai.NotFoundError):  # store: false keeps nothing
        client.responses.retrieve(whole.id)


def test_stream_events_in_order_equal_the_whole_answer(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {"input": "Write a short sentence about the sea.", "max_output_tokens": 16,
                          "include": ["message.output_text.logprobs"], "top_logprobs": 2, **GREEDY}
    whole = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    types = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert types[-1] == ("response.completed" if whole.status == "completed" else "response.incomplete")
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-1].response.output_text
    stored = client.responses.retrieve(events[-1].response.id)
    assert stored.output_text == whole.output_text
    lps = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert lps and all(len(lp.top_logprobs) == 2 for lp in lps)
    assert [lp.token for lp in lps] == [lp.token for lp in whole.output[0].content[0].logprobs]  # type: ignore[union-attr]


@pytest.mark.slow
def test_stream_helper(client: openai.OpenAI) -> None:
    with client.responses.stream(input="Say yes.", max_output_tokens=200, **GREEDY) as s:
        text = "".join(e.delta for e in s if e.type == "response.output_text.delta")
        final = s.get_final_response()
    assert final.status == "completed" and final.output_text == text


def test_function_call_round_trip(client: openai.OpenAI) -> None:
    r = client.responses.create(input="What's the weather in Paris?", tools=[TOOL], tool_choice="required",
                                max_output_tokens=40, **GREEDY)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    out = client.responses.create(previous_response_id=r.id, tools=[TOOL], tool_choice="none",
                                  input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                          "output": "18 degrees, sunny"}], max_output_tokens=12, **GREEDY)
    chat = _chat(client, [
        {"role": "user", "content": "What's the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": calls[0].call_id, "type": "function", "function": {
            "name": "get_weather", "arguments": calls[0].arguments}}]},
        {"role": "tool", "tool_call_id": calls[0].call_id, "content": "18 degrees, sunny"}], 12,
        tools=[{"type": "function", "function": {k: TOOL[k] for k in ("name", "description", "parameters")}}],
        tool_choice="none")
    assert out.output_text == chat.choices[0].message.content
    streamed = list(client.responses.create(stream=True, input="What's the weather in Rome?", tools=[TOOL],
                                            tool_choice="required", max_output_tokens=40, **GREEDY))
    args = "".join(e.delta for e in streamed if e.type == "response.function_call_arguments.delta")
    done = [e for e in streamed if e.type == "response.function_call_arguments.done"]
    assert done and done[0].arguments == args and done[0].name == "get_weather"
    jsonschema.validate(json.loads(args), WEATHER)


def test_delete(client: openai.OpenAI) -> None:
    r = client.responses.create(input="Hi", max_output_tokens=4, **GREEDY)
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(r.id)


@pytest.mark.parametrize(("body", "param"), [
    ({"input": [{"type": "image_generation_call"}]}, "input[0].type"),
    ({"input": [{"role": "wizard", "content": "x"}]}, "input[0].role"),
    ({"input": "hi", "previous_response_id": "resp_nope"}, "previous_response_id"),
    ({"input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]}, "input[0].call_id"),
    ({"input": "hi", "text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "hi", "max_output_tokens": 10**7}, "max_output_tokens"),
    ({"input": "word " * 9000}, "input"),
    ({"input": "hi", "include": ["file_search_call.results"]}, "include[0]"),
    ({"input": 5}, "input"),
])
def test_bad_input_names_the_parameter(server: Any, body: dict[str, Any], param: str) -> None:
    r = httpx.post(f"{server.url}/v1/responses", json={"model": "default", **body}, timeout=60)
    assert 400 <= r.status_code < 500, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"] and err["type"] == "invalid_request_error"
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def test_background_and_cancel(client: openai.OpenAI) -> None:
    r = client.responses.create(input="Tell a long story.", background=True, max_output_tokens=400, **GREEDY)
    assert r.background and r.status == "in_progress"
    cancelled = client.responses.cancel(r.id)
    assert cancelled.status in ("cancelled", "completed", "incomplete")
    again = client.responses.retrieve(r.id)
    assert again.status == cancelled.status
    done = client.responses.create(input="Say ok.", background=True, max_output_tokens=8, **GREEDY)
    events = list(client.responses.retrieve(done.id, stream=True, starting_after=1))
    assert events[0].sequence_number == 2 and events[-1].type in ("response.completed", "response.incomplete")
    assert client.responses.retrieve(done.id).output_text == events[-1].response.output_text


def test_agents_sdk_default_model_with_a_function_tool(server: Any) -> None:
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    agents.set_default_openai_client(openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused",
                                                        max_retries=0, timeout=120), use_for_tracing=False)
    seen: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        seen.append(city)
        return f"It is 18 degrees in {city}."

    agent = agents.Agent(name="weather", instructions="Use the tool.", model="default", tools=[get_weather],
                         tool_use_behavior="stop_on_first_tool",
                         model_settings=agents.ModelSettings(tool_choice="required", temperature=0.0, max_tokens=60))
    result = agents.Runner.run_sync(agent, "What's the weather in Paris?")
    assert len(seen) == 1 and result.final_output == f"It is 18 degrees in {seen[0]}."


@pytest.mark.slow
def test_agents_sdk_plain_answer(server: Any) -> None:
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    agents.set_default_openai_client(openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused",
                                                        max_retries=0, timeout=120), use_for_tracing=False)
    plain = agents.Agent(name="plain", instructions="Answer briefly.", model="default",
                         model_settings=agents.ModelSettings(temperature=0.0, max_tokens=200))
    text = agents.Runner.run_sync(plain, "Say hello.").final_output
    assert isinstance(text, str) and text


@pytest.mark.parametrize(("path", "body", "param", "code"), [
    ("/v1/embeddings", {"input": "hello"}, "model", "model_not_embedding"),
    ("/v1/embeddings", {"input": []}, "input", None),
    ("/v1/embeddings", {"input": "x", "encoding_format": "int8"}, "encoding_format", None),
    ("/v1/rerank", {"query": "q", "documents": ["a", "b"]}, "model", "model_not_embedding"),
    ("/v2/rerank", {"query": "q", "documents": []}, "documents", None),
    ("/v1/score", {"text_1": "a", "text_2": ["b", "c"]}, "model", "model_not_embedding"),
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c"]}, "text_2", None),
])
def test_retrieval_routes_on_a_generative_model_say_what_is_needed(server: Any, path: str, body: dict[str, Any],
                                                                   param: str, code: str | None) -> None:
    r = httpx.post(f"{server.url}{path}", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and (code is None or err["code"] == code)


def test_the_openai_client_gets_the_embeddings_refusal(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="embedding model") as e:
        client.embeddings.create(model="default", input=["a", "b"])
    assert "--task embed" in str(e.value) and e.value.code == "model_not_embedding"


def test_bench_measures_the_responses_stream(server: Any) -> None:
    import asyncio

    from tripod.bench.client import Target, send
    from tripod.bench.datasets import BenchRequest

    async def one() -> Any:
        async with httpx.AsyncClient() as http:
            return await send(http, Target(server.url, "tripod", endpoint="responses"),
                              BenchRequest(max_tokens=4, messages=[{"role": "user", "content": "Hi"}]), 120)

    res = asyncio.run(one())
    assert res.error is None and res.ttft is not None and res.output_tokens == 4 and res.prompt_tokens > 0


@pytest.mark.slow
def test_langchain_use_responses_api(server: Any, client: openai.OpenAI) -> None:
    lc = pytest.importorskip("langchain_openai")
    llm = lc.ChatOpenAI(model="default", base_url=f"{server.url}/v1", api_key="unused", temperature=0,
                        max_tokens=8, use_responses_api=True, max_retries=0)
    msg = llm.invoke("Name a colour.")
    direct = client.responses.create(input="Name a colour.", max_output_tokens=8, **GREEDY)
    assert msg.text == direct.output_text and msg.response_metadata.get("id", "").startswith("resp_")
    streamed = "".join(c.text for c in llm.stream("Name a colour."))
    assert streamed == direct.output_text
