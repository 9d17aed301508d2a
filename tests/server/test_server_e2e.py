"""End to end: a real ``tripod serve`` on 127.0.0.1, driven by the official ``openai`` client."""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Any

import httpx
import openai
import pytest

from tripod.engine.request import SamplingParams

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


@pytest.fixture(scope="module")
def client(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def _stream_chat(client: openai.OpenAI, **kw: Any) -> tuple[dict[int, str], dict[int, str | None], Any]:
    texts: dict[int, str] = {}
    finish: dict[int, str | None] = {}
    usage = None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
            if ch.finish_reason is not None:
                finish[ch.index] = ch.finish_reason
    return texts, finish, usage


def test_models_reports_dtype_and_quantization(client: openai.OpenAI, server: Any) -> None:
    m = client.models.list().data
    assert len(m) == 1
    card = m[0].model_dump()
    assert card["dtype"] == "float32" and card["quantization"] == "Q4_1"
    detail = card["quantization_detail"]  # the format and what computes it (loader/quant_card.py)
    assert detail["format"] == "gguf Q4_1" and card["metadata"]["quantization_detail"] == detail
    assert ("stored Q4_1 blocks" in detail["computed_by"]) == (card["weights"] == "stored")
    assert card["metadata"]["dtype"] == "float32" and card["metadata"]["max_model_len"] == 8192
    assert client.models.retrieve(m[0].id).id == m[0].id


def test_chat_matches_in_process_engine_and_stream(client: openai.OpenAI, model: str, base_engine: Any) -> None:
    """The server's greedy answer is the engine's greedy answer, streamed or not."""
    r = client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=40)
    ids = base_engine.apply_chat_template(QUESTION)
    ref = base_engine.generate(ids, SamplingParams(temperature=0, max_tokens=40))[0]
    assert r.choices[0].message.content == ref.text
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == ref.finish_reason
    u = r.usage
    assert u is not None
    assert u.prompt_tokens == len(ids)
    assert u.completion_tokens == len(ref.token_ids)
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens

    texts, finish, usage = _stream_chat(client, model=model, messages=QUESTION, temperature=0, max_tokens=40)
    assert texts == {0: ref.text}
    assert finish == {0: ref.finish_reason}
    assert usage is not None and usage.completion_tokens == u.completion_tokens
    assert usage.prompt_tokens == u.prompt_tokens


def test_completions_stream_and_not_agree(client: openai.OpenAI, model: str) -> None:
    kw: dict[str, Any] = {"model": model, "prompt": "The three primary colors are", "temperature": 0, "max_tokens": 30}
    full = client.completions.create(**kw)
    parts = []
    finish = None
    usage = None
    for c in client.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if c.usage is not None:
            usage = c.usage
        for ch in c.choices:
            parts.append(ch.text)
            finish = ch.finish_reason or finish
    assert "".join(parts) == full.choices[0].text
    assert finish == full.choices[0].finish_reason
    assert usage is not None and full.usage is not None
    assert usage.completion_tokens == full.usage.completion_tokens


def test_n_and_seed(client: openai.OpenAI, model: str) -> None:
    kw: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": "Tell me a word."}],
                          "temperature": 1.0, "max_tokens": 12, "n": 3, "seed": 1234,
                          "extra_body": {"ignore_eos": True}}
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    assert sorted(c.index for c in a.choices) == [0, 1, 2]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert a.usage is not None
    assert a.usage.completion_tokens == 3 * 12  # ignore_eos: every copy runs to max_tokens
    texts, _, usage = _stream_chat(client, **kw)
    assert texts == {c.index: c.message.content for c in a.choices}
    assert usage is not None and usage.completion_tokens == a.usage.completion_tokens
    other = client.chat.completions.create(**{**kw, "seed": 99})
    assert [c.message.content for c in other.choices] != [c.message.content for c in a.choices]


def test_stop_strings_never_leak(client: openai.OpenAI, model: str) -> None:
    kw: dict[str, Any] = {"model": model, "messages": QUESTION, "temperature": 0, "max_tokens": 40}
    full = client.chat.completions.create(**kw).choices[0].message.content
    assert full and "Paris" in full, full
    stop = "Par"  # a stop string that spans tokens of " Paris" or ends inside one
    cut = full[: full.index(stop)]
    r = client.chat.completions.create(stop=[stop, "\n\n\n"], **kw)
    assert r.choices[0].message.content == cut
    assert r.choices[0].finish_reason == "stop"
    texts, finish, _ = _stream_chat(client, stop=stop, **kw)
    assert texts == {0: cut} and finish == {0: "stop"}


def test_stop_token_ids(client: openai.OpenAI, model: str, base_engine: Any) -> None:
    kw: dict[str, Any] = {"model": model, "prompt": "Count: one, two, three,", "temperature": 0, "max_tokens": 20}
    full = client.completions.create(**kw)
    ids = base_engine.encode("Count: one, two, three,")
    ref = base_engine.generate(ids, SamplingParams(temperature=0, max_tokens=20))[0]
    assert full.choices[0].text == ref.text
    stop_id = ref.token_ids[3]
    first = ref.token_ids.index(stop_id)
    r = client.completions.create(extra_body={"stop_token_ids": [stop_id]}, **kw)
    assert r.choices[0].finish_reason == "stop"
    assert r.usage is not None and r.usage.completion_tokens == first + 1


def test_chat_logprobs(client: openai.OpenAI, model: str) -> None:
    r = client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=8,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and r.usage is not None
    assert len(content) == r.usage.completion_tokens
    joined = "".join(t.token for t in content)
    text = r.choices[0].message.content or ""
    # The EOS that ended a "stop" answer counts as a completion token and has a logprob, but no text.
    assert joined == text or (r.choices[0].finish_reason == "stop" and joined == text + content[-1].token)
    for t in content:
        assert len(t.top_logprobs) == 3
        assert t.top_logprobs[0].token == t.token  # greedy: the chosen token is the best
        assert t.logprob == pytest.approx(t.top_logprobs[0].logprob)
        assert t.logprob <= 0
        if "\ufffd" not in t.token:
            assert t.bytes == list(t.token.encode())


def test_completion_logprobs_and_echo(client: openai.OpenAI, model: str) -> None:
    prompt = "Water boils at"
    r = client.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=6, logprobs=2)
    lp = r.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.top_logprobs is not None
    assert "".join(lp.tokens) == r.choices[0].text
    assert len(lp.tokens) == len(lp.token_logprobs or []) == len(lp.top_logprobs) == 6
    assert all(len(t) == 2 for t in lp.top_logprobs)
    e = client.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=6, echo=True)
    assert e.choices[0].text == prompt + r.choices[0].text


def test_batched_prompts(client: openai.OpenAI, model: str) -> None:
    prompts = ["The sun is", "Cats are"]
    r = client.completions.create(model=model, prompt=prompts, temperature=0, max_tokens=5, n=2)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    by_index = {c.index: c.text for c in r.choices}
    for i, p in enumerate(prompts):
        single = client.completions.create(model=model, prompt=p, temperature=0, max_tokens=5)
        assert by_index[2 * i] == by_index[2 * i + 1] == single.choices[0].text


def test_max_completion_tokens_and_ignore_eos(client: openai.OpenAI, model: str) -> None:
    r = client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_completion_tokens=50,
                                       extra_body={"ignore_eos": True})
    assert r.usage is not None and r.usage.completion_tokens == 50
    assert r.choices[0].finish_reason == "length"


def test_repeated_system_prompt_is_cached(client: openai.OpenAI, model: str) -> None:
    system = "You are a meticulous assistant. " + " ".join(f"Rule {i}: be kind and exact." for i in range(60))
    cached = []
    for q in ("What is 2+2?", "Name a colour."):
        r = client.chat.completions.create(
            model=model, temperature=0, max_tokens=5,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": q}],
        )
        assert r.usage is not None and r.usage.prompt_tokens_details is not None
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
    assert cached[1] >= 400, cached  # the system prompt (~500 tokens) came from the prefix cache


def test_async_client_concurrent_streams_complete_with_usage(server: Any, model: str) -> None:
    """64 concurrent streams through the async client: every one completes, usage exact."""

    async def main() -> list[tuple[int, int, str, int]]:
        ac = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)

        async def one(i: int) -> tuple[int, int, str, int]:
            chunks = 0
            text = ""
            usage = None
            stream = await ac.completions.create(
                model=model, prompt=f"Story number {i}: once upon a time", max_tokens=16 + i % 5,
                temperature=0.8, seed=i, stream=True, stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            async for c in stream:
                if c.usage is not None:
                    usage = c.usage
                for ch in c.choices:
                    chunks += 1
                    text += ch.text
            assert usage is not None
            return i, usage.completion_tokens, text, chunks

        try:
            return await asyncio.gather(*(one(i) for i in range(64)))
        finally:
            await ac.close()

    results = asyncio.run(main())
    assert len(results) == 64
    for i, completion_tokens, text, chunks in results:
        assert completion_tokens == 16 + i % 5
        assert text and chunks >= 1
    s = server.wait_idle()
    assert s["consistent"] is True and s["kv_pinned"] == 0


def test_disconnect_mid_stream_frees_kv(server: Any, model: str) -> None:
    body = {"model": model, "prompt": "Write a very long story about a dragon.", "max_tokens": 3000,
            "stream": True, "ignore_eos": True}
    before = server.engine_stats()
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = 0
        it = r.iter_lines()  # NOTE: kept, so that leaving the loop does not close the stream yet
        for line in it:
            if line.startswith("data: "):
                lines += 1
            if lines >= 5:
                break
        mid = server.engine_stats()
        assert mid["running"] == 1 and mid["kv_free"] < mid["kv_slots"], mid
    after = server.wait_idle()
    # The request was aborted long before its 3000 tokens; its KV is back (free or in the cache,
    # unpinned) and the ownership invariant holds.
    assert after["generated_tokens"] - before["generated_tokens"] < 1000
    assert after["consistent"] is True
    assert after["kv_pinned"] == 0
    assert after["kv_free"] + after["kv_cached"] == after["kv_slots"]


def test_tokenize_detokenize(server: Any, base_engine: Any) -> None:
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": "Hello world"}).json()
    assert r["tokens"] == base_engine.encode("Hello world")
    r2 = httpx.post(f"{server.url}/tokenize", json={"messages": QUESTION}).json()
    assert r2["tokens"] == base_engine.apply_chat_template(QUESTION)
    d = httpx.post(f"{server.url}/detokenize", json={"tokens": r["tokens"]}).json()
    assert d["prompt"].endswith("Hello world")


def test_metrics_and_health(server: Any, client: openai.OpenAI, model: str) -> None:
    client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=4)
    h = httpx.get(f"{server.url}/health")
    assert h.status_code == 200 and h.json()["status"] == "ok"
    text = httpx.get(f"{server.url}/metrics").text

    def value(pattern: str) -> float:
        m = re.search(pattern + r"(?:\{[^}]*\})? ([0-9.e+-]+)", text)
        assert m, f"{pattern} missing from /metrics"
        return float(m.group(1))

    assert value(r"tripod:time_to_first_token_seconds_count") >= 1
    assert value(r"tripod:inter_token_latency_seconds_count") >= 1
    assert value(r"tripod:e2e_request_latency_seconds_count") >= 1
    assert value(r"tripod:generation_tokens_total") >= 4
    assert value(r"tripod:prefix_cache_hits_total") >= 0
    for name in ("tripod:num_requests_running", "tripod:num_requests_waiting", "tripod:kv_cache_usage_perc"):
        value(name)
    assert re.search(r'tripod:http_requests_total\{route="/v1/chat/completions",status="200"\} [1-9]', text)
    assert re.search(r'tripod:request_success_total\{finished_reason="(stop|length)"', text)


def test_sse_wire_format(server: Any) -> None:
    """Raw SSE: every event is `data: <json>`, the last is `data: [DONE]`."""
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json={
        "messages": QUESTION, "max_tokens": 5, "temperature": 0, "stream": True,
    }) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    for e in events[:-1]:
        obj = json.loads(e.removeprefix("data: "))
        assert obj["object"] == "chat.completion.chunk"


def test_async_client_stream_and_not_agree(server: Any, model: str) -> None:
    async def main() -> tuple[str, str, str | None]:
        ac = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
        try:
            kw: dict[str, Any] = {"model": model, "messages": QUESTION, "temperature": 0, "max_tokens": 30,
                                  "extra_body": {"priority": 5}}
            full = await ac.chat.completions.create(**kw)
            parts = []
            async for c in await ac.chat.completions.create(stream=True, **kw):
                parts.extend(ch.delta.content or "" for ch in c.choices)
            return full.choices[0].message.content or "", "".join(parts), full.choices[0].finish_reason
        finally:
            await ac.close()

    full, streamed, finish = asyncio.run(main())
    assert full and full == streamed and finish in ("stop", "length")


def test_response_format_json_object(client: openai.OpenAI, model: str) -> None:
    r = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=3,
                                       response_format={"type": "text"})
    assert r.choices[0].message.content
    r = client.chat.completions.create(
        model=model, max_tokens=200, temperature=0, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Describe Paris as JSON."}],
    )
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content or ""), dict)


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
          "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


def test_json_schema_streamed_with_n_seed_logprobs(client: openai.OpenAI, model: str, server: Any) -> None:
    import jsonschema

    kw: dict[str, Any] = {
        "model": model, "max_tokens": 100, "temperature": 0.9, "seed": 3, "n": 2, "logprobs": True,
        "messages": [{"role": "user", "content": "Invent a person and give their name and age as JSON."}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
    }
    texts, finish, usage = _stream_chat(client, **kw)
    full = client.chat.completions.create(**kw)
    assert texts == {c.index: c.message.content for c in full.choices}  # seeded: same either way
    for i in (0, 1):
        assert finish[i] == "stop"
        jsonschema.validate(json.loads(texts[i]), PERSON)
    assert usage is not None and full.usage is not None and usage.completion_tokens == full.usage.completion_tokens

    # Jump-forward did part of it, and /metrics says so (the engine reports with its heartbeat).
    def accepted() -> float:
        m = re.search(r"tripod:jump_forward_accepted_tokens_total\{[^}]*\} ([0-9.e+]+)", httpx.get(f"{server.url}/metrics").text)
        return float(m.group(1)) if m else 0.0

    deadline = time.monotonic() + 10
    while accepted() == 0:
        assert time.monotonic() < deadline, "no jump-forward tokens in /metrics"
        time.sleep(0.1)


@pytest.mark.parametrize("body", [
    {"regex": r"\d{3}-\d{4}"},
    {"structured_outputs": {"regex": r"\d{3}-\d{4}"}},
    {"guided_regex": r"\d{3}-\d{4}"},
], ids=["tripod-regex", "vllm-structured-outputs", "vllm-guided"])
def test_regex_extensions(client: openai.OpenAI, model: str, body: dict[str, Any]) -> None:
    r = client.completions.create(model=model, prompt="My phone number is", max_tokens=20, extra_body=body)
    assert re.fullmatch(r"\d{3}-\d{4}", r.choices[0].text), r.choices[0].text


def test_choice_and_ebnf_extensions(client: openai.OpenAI, model: str) -> None:
    choices = ["positive", "negative", "neutral"]
    r = client.chat.completions.create(model=model, max_tokens=10, n=3, temperature=1.0,
                                       messages=[{"role": "user", "content": "Sentiment of: I love it!"}],
                                       extra_body={"choice": choices})
    assert all(c.message.content in choices for c in r.choices)
    r = client.chat.completions.create(model=model, max_tokens=30, temperature=0,
                                       messages=[{"role": "user", "content": "Say hi."}],
                                       extra_body={"structured_outputs": {"grammar": 'root ::= "hi" ("!" | ".")'}})
    assert r.choices[0].message.content in ("hi!", "hi.")
