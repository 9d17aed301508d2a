"""The fleet end to end: real ``tripod serve`` replicas, real ``tripod route`` / ``tripod serve
--replicas`` routers, on 127.0.0.1, through the official ``openai`` client where a user would be."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.support.server_helpers import ServerProcess, TripodProcess

REPLICA_ARGS = ("--dtype", "float32", "--kernels", "optimized", "--kv-cache-tokens", "8192", "--threads", "1")
WORDS = ("river mountain lantern copper orchard violet harbor glacier meadow falcon ember quartz willow canyon "
         "saffron thunder marble prairie beacon cobalt juniper tundra velvet compass aurora cedar delta "
         "granite horizon ivory jasmine kestrel lagoon mosaic nectar obsidian pebble quiver raven sierra").split()


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Any:
    tmp = tmp_path_factory.mktemp("replicas")
    with ThreadPoolExecutor(2) as pool:  # start both at once: start-up is most of the cost
        procs = list(pool.map(lambda _: ServerProcess(tmp, *REPLICA_ARGS[4:]), range(2)))
    yield procs
    for p in procs:
        p.stop()


def _router(tmp: Path, replicas: list[ServerProcess], policy: str) -> TripodProcess:
    urls = [a for r in replicas for a in ("--replica", r.url)]
    return TripodProcess(tmp, "route", "--policy", policy, "--health-interval", "0.2", *urls, start_timeout=60)


async def _conversations(url: str, seed: int, convs: int = 5, turns: int = 4) -> dict[str, float]:
    """Multi-turn chats (each turn resends the whole conversation), turns of all chats at once."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    model = (await client.models.list()).data[0].id
    rng = random.Random(seed)
    histories = [[{"role": "system", "content": f"Assistant {seed}-{i}. Notes: " + _text(rng, 160)}]
                 for i in range(convs)]
    totals = {"prompt": 0.0, "cached": 0.0, "later_prompt": 0.0}

    async def turn(h: list[dict[str, str]]) -> tuple[str, Any]:
        text, usage = [], None
        stream = await client.chat.completions.create(
            model=model, messages=h, max_tokens=12, temperature=0, stream=True,  # type: ignore[arg-type]
            stream_options={"include_usage": True})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                text.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                usage = chunk.usage
        return "".join(text), usage

    for t in range(turns):
        for h in histories:
            h.append({"role": "user", "content": f"Turn {t}: one sentence about {rng.choice(WORDS)}."})
        for h, (answer, usage) in zip(histories, await asyncio.gather(*(turn(h) for h in histories)), strict=True):
            h.append({"role": "assistant", "content": answer})
            totals["prompt"] += usage.prompt_tokens
            totals["cached"] += usage.prompt_tokens_details.cached_tokens
            if t > 0:
                totals["later_prompt"] += usage.prompt_tokens
    await client.close()
    return totals


@pytest.mark.slow
def test_cache_aware_routing_finds_more_cache_than_round_robin(replicas: list[ServerProcess], tmp_path: Path) -> None:
    results = {}
    for policy, seed in (("round_robin", 1), ("cache_aware", 2)):  # different chats: no shared cache
        router = _router(tmp_path, replicas, policy)
        try:
            results[policy] = asyncio.run(_conversations(router.url, seed))
        finally:
            assert router.stop() == 0
    rr, ca = results["round_robin"], results["cache_aware"]
    # Cache-aware sends every later turn to the replica holding the turn before: most of its prompt
    # is cached. Round robin (2 replicas, 5 chats, all at once) lands about half the turns elsewhere.
    assert ca["cached"] >= 0.75 * ca["later_prompt"], ca
    # NOTE: compared on the tokens each policy had to compute: both hit the chat template's shared
    # opening on every replica, which pads the cached counts alike and made a ratio of cached
    # tokens fail now and then (3655 vs 2857 cached, yet 2000 vs 2914 computed).
    ca_computed, rr_computed = ca["prompt"] - ca["cached"], rr["prompt"] - rr["cached"]
    assert rr_computed > 1.3 * ca_computed, (ca, rr)


@pytest.mark.slow
def test_tools_and_anthropic_messages_through_the_router(replicas: list[ServerProcess], tmp_path: Path) -> None:
    """Tool calling (OpenAI) and the Anthropic Messages API through ``tripod route`` in front of two
    replicas: the same answers as a replica gives, calls that validate, a tool round trip that stays
    where its conversation is cached, and Anthropic-shaped errors."""
    import anthropic
    import jsonschema

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
              "required": ["city"], "additionalProperties": False}
    router = _router(tmp_path, replicas, "cache_aware")
    try:
        oai = openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0, timeout=120)
        tools: Any = [{"type": "function", "function": {"name": "get_weather", "parameters": schema}}]
        ask: Any = [{"role": "user", "content": "What's the weather in Oslo?"}]
        r = oai.chat.completions.create(model="default", messages=ask, tools=tools, tool_choice="required",
                                        max_tokens=40, temperature=0)
        calls = r.choices[0].message.tool_calls or []
        assert r.choices[0].finish_reason == "tool_calls" and len(calls) == 1
        jsonschema.validate(json.loads(calls[0].function.arguments), schema)
        streamed = "".join(tc.function.arguments or "" for c in oai.chat.completions.create(
            model="default", messages=ask, tools=tools, tool_choice="required", max_tokens=40, temperature=0,
            stream=True) for ch in c.choices for tc in ch.delta.tool_calls or [] if tc.function)
        assert streamed == calls[0].function.arguments

        client = anthropic.Anthropic(base_url=router.url, api_key="none", max_retries=0, timeout=120)
        direct = anthropic.Anthropic(base_url=replicas[0].url, api_key="none", max_retries=0, timeout=120)
        q: Any = [{"role": "user", "content": "Name a colour."}]
        m = client.messages.create(model="default", max_tokens=12, messages=q, extra_body={"temperature": 0})
        ref = direct.messages.create(model="default", max_tokens=12, messages=q, extra_body={"temperature": 0})
        assert m.content[0].text == ref.content[0].text  # type: ignore[union-attr]
        with client.messages.stream(model="default", max_tokens=12, messages=q, extra_body={"temperature": 0}) as st:
            assert "".join(st.text_stream) == ref.content[0].text  # type: ignore[union-attr]
        assert client.messages.count_tokens(model="default", messages=q).input_tokens == \
            direct.messages.count_tokens(model="default", messages=q).input_tokens

        atools: Any = [{"name": "get_weather", "description": "The weather in a city", "input_schema": schema}]
        first = client.messages.with_raw_response.create(
            model="default", max_tokens=40, messages=ask, tools=atools, tool_choice={"type": "any"},
            extra_body={"temperature": 0})
        home = first.headers["x-tripod-replica"]
        msg = first.parse()
        use = next(b for b in msg.content if b.type == "tool_use")
        assert msg.stop_reason == "tool_use"
        jsonschema.validate(use.input, schema)
        history: Any = [*ask, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in msg.content]},
                        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "-3 C"}]}]
        second = client.messages.with_raw_response.create(model="default", max_tokens=8, messages=history,
                                                          tools=atools, extra_body={"temperature": 0})
        assert second.headers["x-tripod-replica"] == home  # the conversation stays where it is cached
        assert (second.parse().usage.cache_read_input_tokens or 0) > msg.usage.input_tokens

        bad = httpx.post(router.url + "/v1/messages", json={"model": "default", "max_tokens": 0, "messages": q})
        assert bad.status_code == 400 and bad.json()["type"] == "error"
        assert bad.json()["error"]["type"] == "invalid_request_error"
    finally:
        assert router.stop() == 0


def test_distinct_prefixes_spread_over_replicas(replicas: list[ServerProcess], tmp_path: Path) -> None:
    router = _router(tmp_path, replicas, "cache_aware")
    try:
        before = {r["url"]: r["routed"] for r in router.fleet()["replicas"]}
        rng = random.Random(7)
        prompts = [f"{i}: " + _text(rng, 40) for i in range(24)]

        async def run() -> list[str]:
            client = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0)
            model = (await client.models.list()).data[0].id
            sem = asyncio.Semaphore(6)

            async def one(p: str) -> str:
                async with sem:
                    r = await client.completions.with_raw_response.create(model=model, prompt=p, max_tokens=4)
                    r.parse()
                    return str(r.headers["x-tripod-replica"])

            names = await asyncio.gather(*(one(p) for p in prompts))
            await client.close()
            return names

        names = asyncio.run(run())
        after = {r["url"]: r["routed"] for r in router.fleet()["replicas"]}
    finally:
        router.stop()
    shares = [names.count(n) / len(names) for n in set(names)]
    assert len(shares) == 2 and max(shares) <= 0.7, names
    assert sum(after.values()) - sum(before.values()) == len(prompts)


_MODELS: dict[str, str] = {}


def _model(url: str) -> str:
    if url not in _MODELS:
        _MODELS[url] = str(httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"])
    return _MODELS[url]


def _stream(url: str, i: int, max_tokens: int, on_chunk: Any = None) -> dict[str, Any]:
    """One streamed chat; what came back: status, replica, content chunks, error event, [DONE]."""
    body = {"model": _model(url), "messages": [{"role": "user", "content": f"Request {i}: count to ten."}],
            "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    out: dict[str, Any] = {"status": None, "replica": None, "chunks": 0, "error": None, "done": False}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=180) as r:
        out["status"], out["replica"] = r.status_code, r.headers.get("x-tripod-replica")
        if r.status_code != 200:
            out["error"] = json.loads(r.read())["error"]
            return out
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                out["done"] = True
                break
            event = json.loads(line[6:])
            if "error" in event:
                out["error"] = event["error"]
                break
            out["chunks"] += 1
            if on_chunk is not None:
                on_chunk(out)
    return out




@pytest.mark.slow
def test_kill_a_replica_during_a_burst(tmp_path: Path) -> None:
    fleet = TripodProcess(tmp_path, "serve", "--replicas", "2", "--router-policy", "round_robin",
                          "--health-interval", "0.2", "--replica-log-dir", str(tmp_path), *REPLICA_ARGS)
    try:
        fleet.wait_for("both replicas", lambda f: all(r["state"] == "healthy" for r in f["replicas"]), 180)
        victim = fleet.replica("replica-0")
        assert victim is not None
        streaming_on_victim = threading.Event()

        def watch(out: dict[str, Any]) -> None:
            if out["replica"] == "replica-0" and out["chunks"] >= 2:
                streaming_on_victim.set()

        with ThreadPoolExecutor(16) as pool:
            burst = [pool.submit(_stream, fleet.url, i, 64, watch) for i in range(12)]
            assert streaming_on_victim.wait(120), "no stream from replica-0 started"
            os.kill(victim["pid"], signal.SIGKILL)
            # Requests arriving right after the kill are answered too (by the survivor).
            late = [pool.submit(_stream, fleet.url, 100 + i, 8) for i in range(4)]
            results = [f.result() for f in burst + late]
        for r in results:
            assert r["status"] == 200, r
            # Streams flowing from the killed replica are continued on the survivor: every one ends.
            assert r["done"] and r["error"] is None and r["chunks"] > 0, r
        page = httpx.get(fleet.url + "/metrics", timeout=10).text
        assert 'tripod:router_continuations_total{outcome="ok"}' in page, "the kill cut no stream"
        # The supervisor restarts it and it serves again.
        f = fleet.wait_for("replica-0 restarted", lambda f: any(
            r["name"] == "replica-0" and r["state"] == "healthy" and r["pid"] != victim["pid"] for r in f["replicas"]), 180)
        assert f["restarts"]["replica-0"] >= 1
        served = [_stream(fleet.url, 200 + i, 4) for i in range(4)]  # round robin: two land on it
        assert all(r["done"] for r in served) and "replica-0" in {r["replica"] for r in served}, served
    finally:
        assert fleet.stop() == 0


@pytest.mark.slow
def test_autoscale_up_under_load_and_down_after_without_losing_requests(tmp_path: Path) -> None:
    fleet = TripodProcess(tmp_path, "serve", "--min-replicas", "1", "--max-replicas", "2", "--target-inflight", "2",
                          "--upscale-delay", "1", "--downscale-delay", "3", "--lookback", "2",
                          "--health-interval", "0.2", "--replica-log-dir", str(tmp_path), *REPLICA_ARGS)
    results: list[dict[str, Any]] = []
    lock = threading.Lock()
    busy = threading.Event()  # set: 6 clients; clear: only the trickle client
    stop = threading.Event()

    def client(k: int) -> None:
        i = 0
        while not stop.is_set():
            if k > 0 and not busy.is_set():
                return
            r = _stream(fleet.url, 1000 * k + i, 24)
            with lock:
                results.append(r)
            i += 1

    try:
        assert len(fleet.fleet()["replicas"]) == 1
        busy.set()
        with ThreadPoolExecutor(6) as pool:
            for k in range(6):
                pool.submit(client, k)
            fleet.wait_for("a second replica serving", lambda f: f["active_replicas"] == 2 and any(
                r["name"] == "replica-1" and r["routed"] > 0 for r in f["replicas"]), 240)
            busy.clear()  # load falls to one client: the fleet drains one replica while it runs
            f = fleet.wait_for("scale-down", lambda f: len(f["replicas"]) == 1 and f["scale_events"][-1]["to"] == 1, 120)
            assert [e["to"] for e in f["scale_events"]] == [2, 1], f["scale_events"]
            with lock:
                n = len(results)
            fleet.wait_for("trickle served after the drain", lambda _: len(results) >= n + 2, 60)
            stop.set()
    finally:
        stop.set()
        code = fleet.stop()
    assert code == 0
    assert len(results) >= 12
    failed = [r for r in results if not r["done"] or r["error"] is not None]
    assert not failed, failed


@pytest.mark.slow
def test_ray_backend_serves_through_the_router(tmp_path: Path) -> None:
    pytest.importorskip("ray")
    fleet = TripodProcess(tmp_path, "serve", "--backend", "ray", "--replicas", "1", "--ray-num-cpus", "1",
                          "--health-interval", "0.2", *REPLICA_ARGS, start_timeout=300)
    try:
        f = fleet.fleet()
        assert f["backend"] == "ray"
        (rep,) = f["replicas"]
        assert rep["state"] == "healthy" and rep["actor_name"].startswith("tripod-replica-0") and rep["node_id"]
        client = openai.OpenAI(base_url=fleet.url + "/v1", api_key="none", max_retries=0)
        model = client.models.list().data[0].id
        raw = client.chat.completions.with_raw_response.create(
            model=model, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=8, temperature=0)
        answer = raw.parse()
        assert raw.headers["x-tripod-replica"] == "replica-0"
        assert answer.choices[0].message.content and answer.usage is not None and answer.usage.completion_tokens > 0
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=8, temperature=0,
            stream=True) if c.choices)
        assert streamed == answer.choices[0].message.content
    finally:
        assert fleet.stop() == 0
