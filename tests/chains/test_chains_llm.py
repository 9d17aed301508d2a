"""Chains with real models: the examples of ``examples/chains/`` on the embedded model (fp32, one
thread, greedy, few tokens), served by ``tripod chains serve`` with its model fleets.

One chain server launches the two fleets (``writer`` and ``judge``) for the draft → critique →
revise example; the other examples reach those models through it (``--model writer=URL``, or
``run_local`` with its URL), so the module starts two engines in all."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.server_helpers import TripodProcess
from tripod import chains
from tripod.chains.loader import load_file

pytestmark = pytest.mark.slow  # two served models: about 30 s (tests/chains/test_chains_serve.py covers chains)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "chains"
MODEL_ARGS = "--model-args=--dtype float32 --kernels optimized --threads 1 --kv-cache-tokens 4096 --max-running 8"
TEXT = " ".join((EXAMPLES / "docs" / name).read_text() for name in ("tides.txt", "glaciers.txt"))


@pytest.fixture(scope="module")
def editor(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TripodProcess]:
    p = TripodProcess(tmp_path_factory.mktemp("chain-editor"), "chains", "serve",
                      str(EXAMPLES / "draft_critique_revise.py"), MODEL_ARGS, start_timeout=240)
    yield p
    assert p.stop() == 0, p.log()[-4000:]


@pytest.fixture(scope="module")
def summarizer(editor: TripodProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TripodProcess]:
    p = TripodProcess(tmp_path_factory.mktemp("chain-summarizer"), "chains", "serve",
                      str(EXAMPLES / "map_reduce.py"), "--model", f"writer={editor.url}", start_timeout=90)
    yield p
    assert p.stop() == 0, p.log()[-4000:]


def _local(url: str) -> chains.LocalRuntime:
    return chains.run_local({"writer": url, "judge": url})


def test_run_local_and_serve_give_the_same_greedy_results(editor: TripodProcess) -> None:
    module = load_file(EXAMPLES / "draft_critique_revise.py")
    served = httpx.post(editor.url + "/run", json={"topic": "tides", "rounds": 1}, timeout=300)
    assert served.status_code == 200, served.text

    async def local() -> Any:
        async with _local(editor.url) as chain:
            return (await chain.handle(module.Editor).run(topic="tides", rounds=1)).model_dump(mode="json")

    essay = served.json()
    assert essay == asyncio.run(local())
    assert essay["topic"] == "tides" and len(essay["critiques"]) == 1
    assert 1 <= essay["critiques"][0]["score"] <= 10 and essay["final"]["title"]  # the schemas held
    graph = httpx.get(editor.url + "/chain", timeout=10).json()
    assert graph["chainlets"]["Critic"]["llms"]["llm"]["model"] == "judge"
    assert set(graph["models"]) == {"writer", "judge"}


def test_one_router_fronts_both_models(editor: TripodProcess) -> None:
    cards = httpx.get(editor.url + "/v1/models", timeout=10).json()["data"]
    assert {c["id"] for c in cards} == {"writer", "judge"} and all(c["ready"] for c in cards)
    before = httpx.get(editor.url + "/fleet", timeout=10).json()["models"]
    r = httpx.post(editor.url + "/v1/chat/completions", timeout=60, json={
        "model": "judge", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert r.status_code == 200 and r.json()["model"] == "judge"
    after = httpx.get(editor.url + "/fleet", timeout=10).json()["models"]
    routed = {m: sum(rep["routed"] for rep in after[m]["replicas"]) - sum(rep["routed"] for rep in before[m]["replicas"])
              for m in after}
    assert routed == {"writer": 0, "judge": 1}
    r = httpx.post(editor.url + "/v1/chat/completions", timeout=10, json={
        "model": "nope", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert r.status_code == 404 and "'writer'" in r.json()["error"]["message"]
    page = httpx.get(editor.url + "/metrics", timeout=10).text
    assert 'model="judge"' in page and "tripod:chainlet_dependency_calls_total" in page


def _items(url: str, body: dict[str, Any]) -> list[str]:
    with httpx.stream("POST", url + "/run", json=body, timeout=300) as r:
        assert r.status_code == 200, r.read()
        out, event = [], "message"
        for line in r.iter_lines():
            if line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:"):
                if event == "message":
                    out.append(json.loads(line[5:]))
                event = "message"
        return out


def test_map_reduce_streams_the_same_answer_served_and_local(summarizer: TripodProcess, editor: TripodProcess) -> None:
    module = load_file(EXAMPLES / "map_reduce.py")
    body = {"text": TEXT, "chunk_words": 40, "max_tokens": 24}
    served = _items(summarizer.url, body)

    async def local() -> list[str]:
        async with _local(editor.url) as chain:
            return [p async for p in chain.handle(module.Summarizer).run(**body)]

    assert len(served) > 3 and served == asyncio.run(local())
    graph = httpx.get(summarizer.url + "/chain", timeout=10).json()
    assert graph["streaming"] and graph["chainlets"]["Mapper"]["replicas"]["routable"] == 2
    assert graph["models"]["writer"]["source"] == "url"


def _replica_metrics(editor: TripodProcess, model: str) -> dict[str, float]:
    [rep] = httpx.get(editor.url + "/fleet", timeout=10).json()["models"][model]["replicas"]
    out: dict[str, float] = {}
    for line in httpx.get(rep["url"] + "/metrics", timeout=10).text.splitlines():
        if line.startswith(("tripod:num_requests_running", "tripod:generation_tokens_total")):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def test_a_client_disconnect_cancels_the_llm_requests_downstream(summarizer: TripodProcess,
                                                                  editor: TripodProcess) -> None:
    before = _replica_metrics(editor, "writer")
    host, port = summarizer.url.removeprefix("http://").split(":")
    data = json.dumps({"text": TEXT, "chunk_words": 200, "max_tokens": 3000, "ignore_eos": True}).encode()
    with socket.create_connection((host, int(port)), timeout=120) as sock:
        sock.sendall(b"POST /run HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
                     + str(len(data)).encode() + b"\r\n\r\n" + data)
        f = sock.makefile("rb")
        assert f.readline().startswith(b"HTTP/1.1 200")
        while not f.readline().startswith(b"data: "):
            pass
        # The reduce step is streaming now (3000 tokens asked for); the client walks away once
        # the replica reports it running (its gauge follows the engine's 0.5 s heartbeat).
        deadline = time.monotonic() + 5
        while _replica_metrics(editor, "writer")["tripod:num_requests_running"] != 1:
            assert time.monotonic() < deadline, _replica_metrics(editor, "writer")
            time.sleep(0.1)  # NOTE: polling for the next heartbeat
        f.close()
    deadline = time.monotonic() + 20
    while (m := _replica_metrics(editor, "writer"))["tripod:num_requests_running"] > 0:
        assert time.monotonic() < deadline, m
        time.sleep(0.1)  # NOTE: the abort travels chain server → Summarizer → router → replica
    generated = m["tripod:generation_tokens_total"] - before.get("tripod:generation_tokens_total", 0.0)  # absent before any token
    assert generated < 1000, generated  # cancelled long before the 3000 tokens
    page = httpx.get(summarizer.url + "/metrics", timeout=10).text
    assert 'tripod:chainlet_calls_total{chainlet="Summarizer",outcome="cancelled"' in page


def test_retrieval_answers_from_the_right_document(editor: TripodProcess) -> None:
    pytest.importorskip("rank_bm25")
    module = load_file(EXAMPLES / "retrieval.py")

    async def local() -> Any:
        async with _local(editor.url) as chain:
            passages = await chain.handle(module.Retriever).run(query="waggle dance of bees", k=2)
            answer = await chain.handle(module.Answerer).run(question="What causes spring tides?", max_tokens=24)
            return passages, answer

    passages, answer = asyncio.run(local())
    assert [p.source for p in passages] == ["honeybees"]
    assert answer.sources[0] == "tides" and answer.answer


@pytest.mark.slow
def test_retrieval_served(editor: TripodProcess, tmp_path: Path) -> None:
    pytest.importorskip("rank_bm25")
    p = TripodProcess(tmp_path, "chains", "serve", str(EXAMPLES / "retrieval.py"), "--model", f"writer={editor.url}",
                      start_timeout=90)
    try:
        r = httpx.post(p.url + "/run", json={"question": "How does a Fresnel lens help?", "max_tokens": 16},
                       timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["sources"][0] == "lighthouses"
    finally:
        assert p.stop() == 0
