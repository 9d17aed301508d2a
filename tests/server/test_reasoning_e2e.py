"""Reasoning output end to end: a real ``tripod serve`` of a tiny random Qwen3 whose chat template
opens the thinking (``<think>`` at the end of the generation prompt, as DeepSeek-R1's does), driven
by the official ``openai`` and ``anthropic`` clients.

The random model thinks in random characters; the thinking budget (tripod's ``thinking_budget``,
Anthropic's ``thinking.budget_tokens``) forces the end of the thinking after a few tokens, and a
JSON schema constrains the answer after it (only the answer: the thinking is free text). Checked:
``reasoning_content`` / thinking blocks apart from the answer, streamed and whole alike, the
markers in neither, every token counted once in ``max_tokens`` and usage, a failover continuation
cut inside the thinking and after it, and the same model served with ``--reasoning-parser none``
unchanged.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest
import torch

from tests.support.server_helpers import ServerProcess
from tests.support.tiny_models import COMMON, save

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
          "required": ["answer"], "additionalProperties": False}
CHAT = [{"role": "user", "content": "Is the sky blue?"}]
BUDGET = 6
RESPONSE_FORMAT: Any = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}


def _thinker(vocab: int) -> Any:
    """A tiny random Qwen3 over the whole vocabulary of the embedded tokenizer (prompts use all of it)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("qwen3", **{**COMMON, "vocab_size": vocab, "head_dim": 16, "eos_token_id": 2})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory, hf_tokenizer: Any) -> Path:
    tok = copy.deepcopy(hf_tokenizer)
    tok.chat_template = TEMPLATE
    return save(_thinker(len(tok)), tmp_path_factory.mktemp("thinker") / "qwen3-thinker", tok)


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = ServerProcess(tmp_path_factory.mktemp("reasoning"), "--model", str(model_dir), "--threads", "1",
                        "--kv-cache-tokens", "4096")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def oai(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(server: ServerProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def _ask(oai: openai.OpenAI, **kw: Any) -> Any:
    extra = {"thinking_budget": BUDGET, "return_token_ids": True, **kw.pop("extra_body", {})}
    return oai.chat.completions.create(**{"model": "default", "messages": CHAT, "max_tokens": 60, "temperature": 0,
                                          "response_format": RESPONSE_FORMAT, "extra_body": extra, **kw})


def test_openai_whole_and_streamed(oai: openai.OpenAI, hf_tokenizer: Any) -> None:
    assert oai.models.list().data[0].model_extra["reasoning_parser"] == "qwen3"  # auto: the template thinks
    r = _ask(oai)
    ch = r.choices[0]
    reasoning, content = ch.message.model_extra["reasoning_content"], ch.message.content
    assert reasoning and content and ch.finish_reason == "stop"
    # The answer (only) follows the schema; the thinking is free text; no marker in either.
    jsonschema.validate(json.loads(content), SCHEMA)
    assert "</think>" not in reasoning + content and "<think>" not in reasoning + content
    # The tokens are the thinking (at most BUDGET tokens), the closing marker, then the answer.
    ids = ch.model_extra["token_ids"]
    raw = hf_tokenizer.decode(ids, skip_special_tokens=True)
    assert raw.startswith(reasoning) and raw.rstrip().endswith(content)
    think_end = raw.index("</think>")
    assert raw[:think_end] == reasoning
    first_marker_token = next(k for k in range(len(ids) + 1) if "<" in hf_tokenizer.decode(ids[:k]))
    assert first_marker_token - 1 <= BUDGET
    assert r.usage is not None and r.usage.completion_tokens == len(ids)

    # Streamed: the same split, every reasoning delta before the first content delta.
    kinds, got = [], {"reasoning_content": "", "content": ""}
    for c in _ask(oai, stream=True):
        for choice in c.choices:
            d = choice.delta.model_dump(exclude_none=True)
            for k in ("reasoning_content", "content"):
                if d.get(k):
                    kinds.append(k)
                    got[k] += d[k]
    assert got == {"reasoning_content": reasoning, "content": content}
    assert kinds == sorted(kinds, key=lambda k: k == "content") and kinds[0] == "reasoning_content"


def test_max_tokens_counts_the_thinking(oai: openai.OpenAI) -> None:
    r = _ask(oai, max_tokens=4, extra_body={"thinking_budget": 50})
    ch = r.choices[0]
    assert ch.finish_reason == "length" and ch.message.content is None
    assert ch.message.model_extra["reasoning_content"]
    assert r.usage is not None and r.usage.completion_tokens == 4


def test_anthropic_thinking_blocks(oai: openai.OpenAI, claude: anthropic.Anthropic) -> None:
    ref = _ask(oai).choices[0].message
    kw: dict[str, Any] = {
        "model": "default", "max_tokens": 60, "messages": CHAT,
        "thinking": {"type": "enabled", "budget_tokens": BUDGET},
        "extra_body": {"temperature": 0, "output_config": {"format": {"type": "json_schema", "schema": SCHEMA}}},
    }
    m = claude.messages.create(**kw)
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert m.content[0].thinking == ref.model_extra["reasoning_content"]
    assert isinstance(m.content[0].signature, str)
    assert m.content[1].text == ref.content and m.stop_reason == "end_turn"

    events = []
    with claude.messages.stream(**kw) as s:
        for e in s:
            if e.type == "content_block_delta":
                events.append(e.delta.type)
        final = s.get_final_message()
    assert events[0] == "thinking_delta" and "text_delta" in events
    assert events == sorted(events, key=lambda t: t == "text_delta")
    assert final.model_dump()["content"] == m.model_dump()["content"]

    # Earlier thinking sent back is accepted (and left out of the prompt).
    again = claude.messages.create(**{**kw, "messages": [*CHAT, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "x", "signature": ""}, {"type": "text", "text": "ok"}]},
        {"role": "user", "content": "Sure?"}]})
    assert [b.type for b in again.content] == ["thinking", "text"]


def test_tool_calls_come_after_the_thinking(oai: openai.OpenAI) -> None:
    params = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
              "required": ["city"], "additionalProperties": False}
    tools: Any = [{"type": "function", "function": {"name": "get_weather", "parameters": params}}]
    for stream in (False, True):
        kw: dict[str, Any] = {"model": "default", "messages": CHAT, "max_tokens": 100, "temperature": 0, "tools": tools,
                              "tool_choice": "required", "extra_body": {"thinking_budget": BUDGET}}
        if not stream:
            m = oai.chat.completions.create(**kw).choices[0]
            reasoning, calls, finish = m.message.model_extra["reasoning_content"], m.message.tool_calls, m.finish_reason
            assert calls is not None
            name, args = calls[0].function.name, calls[0].function.arguments
        else:
            reasoning, name, args, finish = "", "", "", None
            for c in oai.chat.completions.create(**kw, stream=True):
                for ch in c.choices:
                    d = ch.delta
                    reasoning += (d.model_extra or {}).get("reasoning_content") or ""
                    for tc in d.tool_calls or []:
                        assert tc.function is not None
                        name += tc.function.name or ""
                        args += tc.function.arguments or ""
                    finish = ch.finish_reason or finish
        assert reasoning and "<tool_call>" not in reasoning, stream
        assert name == "get_weather" and finish == "tool_calls", stream
        jsonschema.validate(json.loads(args), params)


def _sse(server: ServerProcess, body: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                obj = json.loads(line[6:])
                assert "error" not in obj, obj
                out.append(obj)
    return out


def _parts(chunks: list[dict[str, Any]]) -> tuple[str, str]:
    d = [ch["delta"] for c in chunks for ch in c["choices"]]
    return "".join(x.get("reasoning_content") or "" for x in d), "".join(x.get("content") or "" for x in d)


def test_failover_continuation_across_the_boundary(server: ServerProcess) -> None:
    body = {"model": "default", "messages": CHAT, "max_tokens": 60, "temperature": 0, "thinking_budget": BUDGET,
            "response_format": RESPONSE_FORMAT, "tripod_failover": True}
    ref = _sse(server, body)
    want = _parts(ref)
    points = [(j, c["choices"][0]["tripod"]) for j, c in enumerate(ref) if c["choices"] and "tripod" in c["choices"][0]]
    first_content = next(j for j, c in enumerate(ref) if c["choices"] and c["choices"][0]["delta"].get("content"))
    cuts = [p for p in points if p[0] < first_content][1:2] + [p for p in points if p[0] >= first_content][:1]
    assert len(cuts) == 2, points
    for j, _ in cuts:
        tokens = [t for c in ref[: j + 1] for ch in c["choices"] if "tripod" in ch for t in ch["tripod"]["token_ids"]]
        chars = ref[j]["choices"][0]["tripod"]["chars"]
        cont = {"id": ref[0]["id"], "created": ref[0]["created"],
                "choices": [{"index": 0, "token_ids": tokens, "chars": chars}]}
        rest = _sse(server, {**body, "tripod_continuation": cont})
        before, after = _parts(ref[: j + 1]), _parts(rest)
        assert (before[0] + after[0], before[1] + after[1]) == want, j


@pytest.fixture(scope="module")
def plain(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = ServerProcess(tmp_path_factory.mktemp("plain"), "--model", str(model_dir), "--threads", "1",
                        "--kv-cache-tokens", "4096", "--reasoning-parser", "none")
    yield srv
    srv.stop()


@pytest.mark.slow
def test_without_a_parser_the_answer_is_unchanged(plain: ServerProcess, oai: openai.OpenAI) -> None:
    client = openai.OpenAI(base_url=f"{plain.url}/v1", api_key="unused", max_retries=0, timeout=120)
    assert client.models.list().data[0].model_extra["reasoning_parser"] is None
    body: dict[str, Any] = {"model": "default", "messages": CHAT, "max_tokens": 12, "temperature": 0}
    got = client.chat.completions.create(**body).choices[0].message
    thinking = oai.chat.completions.create(**body).choices[0].message
    # The same tokens: without a parser, all of it is the content, with no reasoning_content.
    assert "reasoning_content" not in (got.model_extra or {})
    assert got.content == thinking.model_extra["reasoning_content"] + (thinking.content or "")
    # The schema then constrains the whole output; a thinking budget needs a parser.
    whole = client.chat.completions.create(**body, response_format=RESPONSE_FORMAT).choices[0].message.content
    jsonschema.validate(json.loads(whole), SCHEMA)
    with pytest.raises(openai.BadRequestError, match="thinking_budget"):
        client.chat.completions.create(**body, extra_body={"thinking_budget": 4})
    c2 = anthropic.Anthropic(base_url=plain.url, api_key="unused", max_retries=0, timeout=120)
    with pytest.raises(anthropic.BadRequestError, match="reasoning parser"):
        c2.messages.create(model="default", max_tokens=20, messages=CHAT,
                           thinking={"type": "enabled", "budget_tokens": 8})
