"""Mid-answer failover end to end: a real fleet (``tripod serve --replicas 3``, fp32, the embedded
model), the official ``openai`` client, and a replica's server process — or its engine process —
killed with SIGKILL while it streams. Every answer equals the undisturbed one from the same fleet,
token for token: greedy, seeded sampling with ``n`` = 2, a JSON-schema answer (which still
validates), a stop string, a streamed completion and a whole (non-streamed) answer.

The answers share a long system prompt and the router weighs only the prefix cache
(``--load-weight 0``), so they all run on the replica that holds the prompt: one kill cuts all of
them mid-answer (each has had its first chunks by then), and the others continue them.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.server_helpers import TripodProcess, assert_same_answer

pytestmark = pytest.mark.slow  # a fleet killed twice: about 40 s (tests/router/test_router_failover.py covers the policy)

REPLICA_ARGS = ("--dtype", "float32", "--kernels", "optimized", "--kv-cache-tokens", "8192", "--threads", "1")
SYSTEM = ("You are a careful assistant for a lighthouse museum. " * 12).strip()
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                           "year": {"type": "integer"},
                                           "facts": {"type": "array", "items": {"type": "string", "maxLength": 40},
                                                     "maxItems": 3}},
          "required": ["name", "year", "facts"], "additionalProperties": False}
CUT_AFTER = 6  # chunks every stream has had before the kill


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TripodProcess]:
    tmp = tmp_path_factory.mktemp("failover")
    f = TripodProcess(tmp, "serve", "--replicas", "3", "--load-weight", "0", "--balance-abs", "16",
                      "--health-interval", "0.2", "--max-retries", "2", "--stall-timeout", "20",
                      "--replica-log-dir", str(tmp), *REPLICA_ARGS, start_timeout=300)
    try:
        healthy(f, 3)
        yield f
    finally:
        assert f.stop() == 0


def healthy(fleet: TripodProcess, n: int) -> None:
    fleet.wait_for(f"{n} healthy replicas", lambda f: sum(r["state"] == "healthy" for r in f["replicas"]) >= n, 300)


def metric(fleet: TripodProcess, name: str, **labels: str) -> float:
    text = httpx.get(fleet.url + "/metrics", timeout=10).text
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def messages(user: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


def client(fleet: TripodProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=fleet.url + "/v1", api_key="none", max_retries=0, timeout=180)


def chat_stream(fleet: TripodProcess, kw: dict[str, Any], cut: threading.Barrier | None) -> dict[str, Any]:
    """Stream a chat answer; after ``CUT_AFTER`` chunks wait at ``cut`` (the kill happens there)."""
    raw = client(fleet).chat.completions.with_raw_response.create(stream=True, **kw)
    out: dict[str, Any] = {"replica": raw.headers["x-tripod-replica"], "text": {}, "ids": set(), "finish": {},
                           "usage": None}
    for n, c in enumerate(raw.parse(), 1):
        out["ids"].add(c.id)
        if c.usage is not None:
            out["usage"] = (c.usage.prompt_tokens, c.usage.completion_tokens)
        for ch in c.choices:
            out["text"][ch.index] = out["text"].get(ch.index, "") + (ch.delta.content or "")
            if ch.finish_reason:
                out["finish"][ch.index] = ch.finish_reason
        if cut is not None and n == CUT_AFTER:
            cut.wait(120)
    return out


def completion_stream(fleet: TripodProcess, kw: dict[str, Any], cut: threading.Barrier | None) -> dict[str, Any]:
    raw = client(fleet).completions.with_raw_response.create(stream=True, **kw)
    out: dict[str, Any] = {"replica": raw.headers["x-tripod-replica"], "text": {0: ""}, "ids": set(), "finish": {},
                           "usage": None}
    for n, c in enumerate(raw.parse(), 1):
        out["ids"].add(c.id)
        for ch in c.choices:
            out["text"][0] += ch.text
            if ch.finish_reason:
                out["finish"][0] = ch.finish_reason
        if cut is not None and n == CUT_AFTER:
            cut.wait(120)
    return out


def run_all(fleet: TripodProcess, jobs: list[Callable[[threading.Barrier | None], dict[str, Any]]],
            kill: Callable[[str], None] | None) -> list[dict[str, Any]]:
    """Run ``jobs`` at once; with ``kill``, once every stream has had its first chunks, kill the
    replica serving the first one (``kill(replica name)``) and let them all go on."""
    cut = threading.Barrier(len(jobs) + 1) if kill is not None else None
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = [pool.submit(job, cut) for job in jobs]
        if cut is not None and kill is not None:
            cut.wait(180)
            kill(first_replica(fleet))
        return [f.result() for f in futures]


def first_replica(fleet: TripodProcess) -> str:
    busy = [r for r in fleet.fleet()["replicas"] if r["inflight"]]
    assert len(busy) == 1, f"the answers are not all on one replica: {busy}"
    return str(busy[0]["name"])


def the_answers(fleet: TripodProcess, user: str) -> list[Callable[[threading.Barrier | None], dict[str, Any]]]:
    """Greedy, seeded n = 2, JSON schema, and a stop string (found in the greedy answer's second
    half, so it spans the cut), all sharing the system prompt."""
    base = {"model": "default", "messages": messages(user), "max_tokens": 72, "stream_options": {"include_usage": True}}
    greedy = {**base, "temperature": 0, "extra_body": {"ignore_eos": True}}
    seeded = {**base, "temperature": 0.9, "top_p": 0.95, "seed": 17, "n": 2, "frequency_penalty": 0.4,
              "extra_body": {"ignore_eos": True}}
    js = {**base, "messages": messages(user + " Answer as JSON."), "temperature": 0,
          "response_format": {"type": "json_schema", "json_schema": {"name": "lighthouse", "schema": SCHEMA}}}
    ref = chat_stream(fleet, greedy, None)["text"][0]
    stop = ref[int(len(ref) * 0.7):][:5]
    assert len(stop) == 5 and ref.index(stop) > len(ref) // 2, ref
    stopped = {**base, "temperature": 0, "stop": [stop]}
    return [lambda c, kw=kw: chat_stream(fleet, kw, c) for kw in (greedy, seeded, js, stopped)]


def test_killing_the_replica_mid_stream_the_client_never_sees_it(fleet: TripodProcess) -> None:
    healthy(fleet, 3)
    jobs = the_answers(fleet, "Tell me the story of the oldest lighthouse.")
    want = run_all(fleet, jobs, None)
    ok = metric(fleet, "tripod:router_continuations_total", outcome="ok")
    killed: list[int] = []

    def kill(name: str) -> None:
        rep = fleet.replica(name)
        assert rep is not None
        killed.append(rep["pid"])
        os.kill(rep["pid"], signal.SIGKILL)  # the replica's server process

    got = run_all(fleet, jobs, kill)
    assert killed
    for g, w in zip(got, want, strict=True):
        assert g["text"] == w["text"]  # token-identical text, every choice
        assert g["finish"] == w["finish"]
        assert len(g["ids"]) == 1  # one answer id from the first chunk to the last
        assert g["usage"][0] == w["usage"][0] and g["usage"][1] == w["usage"][1]  # prompt once, every token
    jsonschema.validate(json.loads(got[2]["text"][0]), SCHEMA)
    assert got[3]["finish"] == {0: "stop"} and len(got[3]["text"][0]) < len(got[0]["text"][0])
    assert metric(fleet, "tripod:router_continuations_total", outcome="ok") - ok >= 4  # each was continued
    assert metric(fleet, "tripod:router_continuations_total", outcome="exhausted") == 0


def test_killing_the_engine_mid_answer_continues_streams_and_whole_answers(fleet: TripodProcess) -> None:
    """The engine process dies: its server answers the open requests with a 5xx error event and
    exits; the router continues them. A non-streamed answer is continued inside the router."""
    healthy(fleet, 2)
    user = "List facts about lighthouse lenses."
    seeded = {"model": "default", "prompt": SYSTEM + "\n" + user, "max_tokens": 64, "temperature": 0.8, "seed": 5,
              "extra_body": {"ignore_eos": True}}
    whole = {"model": "default", "prompt": SYSTEM + "\n" + user, "max_tokens": 96, "temperature": 0, "logprobs": 2,
             "extra_body": {"ignore_eos": True}}
    c = client(fleet)
    want_whole = c.completions.create(**whole)
    want = run_all(fleet, [lambda cut: completion_stream(fleet, seeded, cut)], None)
    ok = metric(fleet, "tripod:router_continuations_total", outcome="ok")
    results: dict[str, Any] = {}
    whole_thread = threading.Thread(target=lambda: results.setdefault("whole", c.completions.create(**whole)))

    def kill(name: str) -> None:
        rep = fleet.replica(name)
        assert rep is not None
        # The whole answer is under way too (it started first): give it a few tokens more.
        deadline = time.monotonic() + 60
        while rep["inflight"] < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
            rep = fleet.replica(name) or rep
        engine = httpx.get(rep["url"] + "/health", timeout=10).json()["engine_pid"]
        os.kill(engine, signal.SIGKILL)

    whole_thread.start()
    got = run_all(fleet, [lambda cut: completion_stream(fleet, seeded, cut)], kill)
    whole_thread.join(180)
    assert got[0]["text"] == want[0]["text"] and len(got[0]["ids"]) == 1
    w = results["whole"]
    assert [ch.text for ch in w.choices] == [ch.text for ch in want_whole.choices]
    assert_same_answer([ch.logprobs.model_dump() for ch in w.choices], [ch.logprobs.model_dump() for ch in want_whole.choices])
    assert (w.usage.prompt_tokens, w.usage.completion_tokens) == \
        (want_whole.usage.prompt_tokens, want_whole.usage.completion_tokens)
    assert metric(fleet, "tripod:router_continuations_total", outcome="ok") - ok >= 1
