"""Speculative decoding, served: ``tripod serve --speculative``, the per-request ``speculative``
field, the ``tripod:spec_decode_*`` metrics, ``/v1/models``, and what ``tripod bench`` reads.

One server (``--speculative ngram``) for the module; the rest runs without a model.
"""

from __future__ import annotations

import random
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.support.server_helpers import ServerProcess
from tripod.bench.copy_tasks import copy_prompts
from tripod.bench.datasets import make_requests
from tripod.bench.spec import parse_metrics, summarize_spec
from tripod.engine.request import SamplingParams
from tripod.protocol import engine_ipc
from tripod.protocol.stats import EngineStats, SpecDecodeCounts
from tripod.server.metrics import ServerMetrics

# An answer that copies its prompt: what prompt-lookup (ngram) drafting is for.
COPY = ("Repeat the following list exactly, one item per line:\n"
        + "\n".join(f"{i}. {w}" for i, w in enumerate(
            "apples bread copper lemons umbrella olive batteries walnuts honey chalk soap sugar".split(), 1)))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    s = ServerProcess(tmp_path_factory.mktemp("spec"), "--speculative", "ngram", "--num-draft-tokens", "4")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def _spec_counts(server: ServerProcess) -> dict[str, dict[str, float]]:
    counts = parse_metrics(httpx.get(f"{server.url}/metrics", timeout=10).text)
    assert counts is not None, "the server exposes no tripod:spec_decode_* counters"
    return counts


def _counts_after(server: ServerProcess, before: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """The counters once they differ from ``before`` (they arrive with the engine's heartbeat,
    every 0.5 s), or as they are after 5 s."""
    deadline = time.monotonic() + 5
    now = _spec_counts(server)
    while now == before and time.monotonic() < deadline:
        time.sleep(0.1)  # polling /metrics for the next heartbeat
        now = _spec_counts(server)
    return now


def _copy_answer(client: openai.OpenAI, model: str, **extra: Any) -> str:
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": COPY}], max_tokens=48,
                                       temperature=0, **extra)
    return r.choices[0].message.content or ""


@pytest.mark.slow
def test_speculation_does_not_change_greedy_text(client: openai.OpenAI, model: str) -> None:
    spec = _copy_answer(client, model)
    plain = _copy_answer(client, model, extra_body={"speculative": False})
    assert spec == plain and spec.strip()
    comp = [client.completions.create(model=model, prompt=COPY + "\n1.", max_tokens=24, temperature=0,
                                      extra_body=extra).choices[0].text
            for extra in ({}, {"speculative": False})]
    assert comp[0] == comp[1]


def test_stop_string_inside_an_accepted_run(client: openai.OpenAI, model: str, server: ServerProcess) -> None:
    """A stop string completed inside a speculated run ends the answer at that token: the same
    text and the same completion_tokens as plain decoding, streamed or not."""
    before = _spec_counts(server)
    answers = []
    for extra in ({}, {"speculative": False}):
        r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": COPY}], max_tokens=60,
                                           temperature=0, stop=["Honey"], extra_body=extra)
        assert r.choices[0].finish_reason == "stop" and r.usage is not None
        answers.append((r.choices[0].message.content, r.usage.completion_tokens))
        stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": COPY}],
                                                max_tokens=60, temperature=0, stop=["Honey"], stream=True,
                                                stream_options={"include_usage": True}, extra_body=extra)
        text, usage = "", None
        for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
        answers.append((text, usage))
    assert len(set(answers)) == 1, answers
    assert "Copper" in answers[0][0] and "Honey" not in answers[0][0]  # the model copies "1. Apples 2. Bread 3. Copper …"
    assert _counts_after(server, before) != before  # the speculated runs did carry drafts


def test_metrics_count_ngram_drafts(client: openai.OpenAI, model: str, server: ServerProcess) -> None:
    """Needs the engine side of issue 12 (an engine that speculates): the server's part is the
    heartbeat's ``spec_decode`` turned into counters."""
    assert "tripod:spec_decode_num_drafts_total" in httpx.get(f"{server.url}/metrics", timeout=10).text
    before = _spec_counts(server)
    _copy_answer(client, model)
    delta = summarize_spec(before, _counts_after(server, before))
    assert delta is not None
    assert set(delta["by_proposer"]) == {"ngram"}, delta
    assert delta["draft_tokens"] > 0 and delta["drafts"] > 0
    assert 0 <= delta["accepted_tokens"] <= delta["draft_tokens"]


def test_models_reports_the_method(server: ServerProcess) -> None:
    card = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]
    assert card["speculative"]["method"] == "ngram"
    assert card["speculative"]["num_draft_tokens"] == 4
    assert card["metadata"]["speculative"] == card["speculative"]


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
    ("/v1/messages", {"model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}),
])
@pytest.mark.parametrize("value", ["yes", 1, None])
def test_speculative_must_be_a_boolean(server: ServerProcess, path: str, body: dict[str, Any], value: Any) -> None:
    r = httpx.post(f"{server.url}{path}", json={**body, "speculative": value}, timeout=30)
    assert r.status_code == 400, r.text
    assert "speculative" in r.text and "boolean" in r.text


def test_openai_client_gets_a_400_for_a_bad_value(client: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError, match="speculative"):
        _copy_answer(client, model, extra_body={"speculative": "no"})


def test_anthropic_messages_accept_the_field(server: ServerProcess) -> None:
    body = {"model": "default", "messages": [{"role": "user", "content": COPY}], "max_tokens": 24, "temperature": 0}
    texts = [httpx.post(f"{server.url}/v1/messages", json={**body, "speculative": s}, timeout=60).json()
             ["content"][0]["text"] for s in (True, False)]
    assert texts[0] == texts[1]


# ------------------------------------------------------------------------- no model needed
@pytest.mark.parametrize("args, words", [
    (("--speculative", "bogus"), "speculative must be"),
    (("--speculative", "self:0"), "self:K"),
    (("--speculative", "ngram", "--num-draft-tokens", "0"), "num_draft_tokens"),
    (("--replicas", "2", "--speculative", "draft:"), "draft:PATH"),
])
def test_cli_refuses_bad_values(args: tuple[str, ...], words: str) -> None:
    r = subprocess.run([sys.executable, "-m", "tripod.cli", "serve", "--port", "0", *args],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert words in r.stderr


def test_fleet_forwards_the_options() -> None:
    from tripod.cli import build_parser, replica_args

    args = build_parser().parse_args(["serve", "--replicas", "2", "--speculative", "self:6",
                                      "--num-draft-tokens", "3", "--spec-max-batch", "2"])
    forwarded = " ".join(replica_args(args, 1))
    assert "--speculative self:6 --num-draft-tokens 3 --spec-max-batch 2" in forwarded


def test_ipc_carries_the_field() -> None:
    for value in (True, False):
        msg = engine_ipc.decode(engine_ipc.encode(engine_ipc.AddRequest("r", [1, 2], SamplingParams(speculative=value))))
        assert msg.params.speculative is value


def test_metrics_add_heartbeat_deltas_per_proposer() -> None:
    m = ServerMetrics("m")
    hb: dict[str, Any] = {"running": 0, "waiting": 0, "kv_slots": 8, "kv_free": 8, "kv_cached": 0, "kv_pinned": 0}
    m.on_heartbeat(EngineStats(**hb, spec_decode={"ngram": SpecDecodeCounts(2, 8, 5)}))
    m.on_heartbeat(EngineStats(**hb, spec_decode={"ngram": SpecDecodeCounts(3, 12, 6),
                                                   "jump_forward": SpecDecodeCounts(1, 4, 4)}))
    m.on_heartbeat(EngineStats(**hb))  # an engine without speculation sends no entries
    counts = parse_metrics(m.render().decode())
    assert counts == {"ngram": {"drafts": 3, "draft_tokens": 12, "accepted_tokens": 6},
                      "jump_forward": {"drafts": 1, "draft_tokens": 4, "accepted_tokens": 4}}


def test_bench_reads_tripod_and_vllm_counters() -> None:
    assert parse_metrics("tripod:num_requests_running 0\n") is None
    assert parse_metrics("# TYPE tripod:spec_decode_num_drafts_total counter\n") == {}
    vllm = ('vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10\n'
            'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 40\n'
            'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 20\n'
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 9\n')
    s = summarize_spec({}, parse_metrics(vllm))
    assert s is not None
    assert (s["acceptance_rate"], s["mean_accepted_length"]) == (0.5, 3.0)
    assert summarize_spec(None, None) is None


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from tripod.loader import load_tokenizer

    return load_tokenizer(None).tokenizer


def test_copy_dataset(tokenizer: Any) -> None:
    reqs = make_requests("copy", 8, tokenizer, isl=300, osl=200, seed=3)
    assert [r.messages for r in reqs] == [r.messages for r in make_requests("copy", 8, tokenizer, isl=300, osl=200,
                                                                            seed=3)]  # seeded
    assert len({r.messages[0]["content"] for r in reqs if r.messages}) == 8
    for r in reqs:
        assert r.messages is not None and r.max_tokens == 200 and r.extra == {"ignore_eos": False}
        n = len(tokenizer.encode(r.messages[0]["content"], add_special_tokens=False))
        assert 150 <= n <= 330, (n, r.messages[0]["content"][:200])
    texts = copy_prompts(4, tokenizer, 300, random.Random(0))
    assert "fixing the typos" in texts[0] and "```python" in texts[1] and "reverse order" in texts[2]


def test_speculative_benchmark_script_help() -> None:
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "speculative.py"
    r = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "--methods" in r.stdout
