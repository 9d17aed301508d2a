"""Prefill/decode disaggregation end to end: ``tripod serve --replicas 1 --prefill-replicas 1`` (a
router, a prefill replica, a decode replica: real processes on 127.0.0.1) answers exactly as one
ordinary replica does, through the official ``openai`` client, with the prompt's KV handed over;
a follow-up hits the decode replica's prefix cache; a prefill replica SIGKILLed mid-transfer costs
a fallback, never a wrong answer. The fleet decodes with ``--speculative ngram`` and the reference
replica without: speculation is lossless, so their answers agree too."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from openai import OpenAI

from tests.support.lora_adapters import random_adapter
from tests.support.server_helpers import ServerProcess, TripodProcess, assert_same_answer
from tripod.loader import load_tokenizer
from tripod.server.api.pd import KILL_HOOK

pytestmark = pytest.mark.slow  # a disaggregated fleet and a reference replica: about 50 s (test_pd_route_e2e.py
# and tests/memory/test_kv_transfer.py stay in the default run)

ARGS = ("--dtype", "float32", "--kernels", "optimized", "--kv-cache-tokens", "8192")
ADAPTER = "dispatch-lora"
KILL_AFTER = 12  # blocks: the kill hook fires on the first transfer longer than this (the long prompt only)
NOTES = ("The depot dispatches vans at seven, ten and two. Fragile parcels ride in the front cage, cold chain "
         "goods in the blue boxes, and anything over thirty kilograms needs two handlers and a trolley. Drivers "
         "log each stop on the handset and photograph the parcel at the door. Returns go back to bay four.")


def _system(case: str, repeat: int = 1) -> str:
    return f"Case {case}. You are the depot's dispatcher. " + " ".join([NOTES] * repeat)


@pytest.fixture(scope="module")
def marker(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("pd-hook") / "fired"


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory, marker: Path) -> Iterator[tuple[TripodProcess, ServerProcess]]:
    tmp = tmp_path_factory.mktemp("pd")
    adapter = random_adapter(tmp / "adapter", load_tokenizer(None).config, rank=4, seed=3)
    lora = ("--lora", f"{ADAPTER}={adapter}")
    old = os.environ.get(KILL_HOOK)
    os.environ[KILL_HOOK] = f"{KILL_AFTER}:{marker}"  # the fleet's replicas inherit it
    try:
        with ThreadPoolExecutor(2) as pool:  # start-up is most of the cost: both at once
            fleet_f = pool.submit(TripodProcess, tmp, "serve", "--replicas", "1", "--prefill-replicas", "1", *ARGS,
                                  *lora, "--speculative", "ngram", "--health-interval", "0.2", "--replica-log-dir",
                                  str(tmp))
            ref_f = pool.submit(ServerProcess, tmp, "--threads", "1", *lora)
            fleet, ref = fleet_f.result(), ref_f.result()
    finally:
        if old is None:
            os.environ.pop(KILL_HOOK, None)
        else:
            os.environ[KILL_HOOK] = old
    fleet.wait_for("a healthy prefill and decode replica",
                   lambda f: sorted(r["role"] for r in f["replicas"] if r["state"] == "healthy") == ["decode", "prefill"],
                   60)
    yield fleet, ref
    fleet.stop()
    ref.stop()


def _chat(url: str, **kw: Any) -> Any:
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    return client.chat.completions.create(**{"model": "default", **kw})


def _pd(fleet: TripodProcess) -> dict[str, Any]:
    return dict(fleet.fleet()["pd"])


def _decode_url(fleet: TripodProcess) -> str:
    return str(next(r["url"] for r in fleet.fleet()["replicas"] if r["role"] == "decode"))


def _metric(url: str, name: str, label: str = "") -> float:
    """The sum of ``name``'s series (those whose labels contain ``label``) on ``url``'s /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(m.group(2)) for m in re.finditer(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", text, re.M)
               if label in (m.group(1) or ""))


@pytest.mark.parametrize("case, kw", [
    ("greedy", {"temperature": 0, "max_tokens": 12, "logprobs": True, "top_logprobs": 2}),
    ("seeded", {"temperature": 0.9, "top_p": 0.95, "seed": 11, "max_tokens": 12}),
    ("json", {"temperature": 0, "max_tokens": 40, "response_format": {"type": "json_schema", "json_schema": {
        "name": "stop", "schema": {"type": "object", "properties": {"bay": {"type": "integer"}},
                                   "required": ["bay"], "additionalProperties": False}}}}),
])
def test_pd_answers_as_a_single_replica(servers: tuple[TripodProcess, ServerProcess], case: str,
                                        kw: dict[str, Any]) -> None:
    fleet, ref = servers
    msgs = [{"role": "system", "content": _system(case)}, {"role": "user", "content": "Where do returns go?"}]
    before = _pd(fleet)
    got, want = _chat(fleet.url, messages=msgs, **kw), _chat(ref.url, messages=msgs, **kw)
    assert_same_answer([c.model_dump() for c in got.choices], [c.model_dump() for c in want.choices])
    assert got.usage.prompt_tokens == want.usage.prompt_tokens > 80
    after = _pd(fleet)
    assert after["ok"] == before["ok"] + 1, after
    # The decode replica had never seen this prompt: its cached tokens are the handed-over blocks.
    cached = got.usage.prompt_tokens_details.cached_tokens
    assert cached == (got.usage.prompt_tokens - 1) // 16 * 16, (cached, got.usage.prompt_tokens)
    if case == "json":
        assert '"bay"' in (got.choices[0].message.content or "")


def test_a_follow_up_hits_the_decode_replicas_prefix_cache(servers: tuple[TripodProcess, ServerProcess]) -> None:
    fleet, ref = servers
    msgs = [{"role": "system", "content": _system("follow-up")}, {"role": "user", "content": "When do vans leave?"}]
    first = _chat(fleet.url, messages=msgs, temperature=0, max_tokens=10)
    msgs += [{"role": "assistant", "content": first.choices[0].message.content or ""},
             {"role": "user", "content": "And the last one?"}]
    before = _pd(fleet)
    got, want = _chat(fleet.url, messages=msgs, temperature=0, max_tokens=10), \
        _chat(ref.url, messages=msgs, temperature=0, max_tokens=10)
    assert got.choices[0].message.content == want.choices[0].message.content
    after = _pd(fleet)
    assert after["skipped"] == before["skipped"] + 1 and after["ok"] == before["ok"], after
    assert got.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 16


def test_a_lora_adapters_prompt_is_prefilled_where_it_is_answered(
        servers: tuple[TripodProcess, ServerProcess]) -> None:
    """An adapter's prefixes live in its own cache namespace, which the disk tier does not carry: the
    prefill replica declines (422), the router counts it skipped, the answer is the adapter's."""
    fleet, ref = servers
    msgs = [{"role": "system", "content": _system("lora")}, {"role": "user", "content": "Where do returns go?"}]
    before = _pd(fleet)
    got = _chat(fleet.url, messages=msgs, model=ADAPTER, temperature=0, max_tokens=10)
    want = _chat(ref.url, messages=msgs, model=ADAPTER, temperature=0, max_tokens=10)
    base = _chat(ref.url, messages=msgs, temperature=0, max_tokens=10)
    assert got.choices[0].message.content == want.choices[0].message.content != base.choices[0].message.content
    after = _pd(fleet)
    assert after["skipped"] == before["skipped"] + 1 and after["ok"] == before["ok"] and after["refused"] == 0


def test_completions_through_pd_one_prompt_and_several(servers: tuple[TripodProcess, ServerProcess]) -> None:
    fleet, ref = servers
    prompts = [_system(f"completion {i}") + "\nThe fragile parcels ride" for i in range(3)]
    for prompt in (prompts[0], prompts[1:]):  # several prompts: their blocks travel in one stream
        args = {"model": "default", "prompt": prompt, "max_tokens": 8, "temperature": 0}
        before = _pd(fleet)
        got = httpx.post(f"{fleet.url}/v1/completions", json=args, timeout=120).json()
        want = httpx.post(f"{ref.url}/v1/completions", json=args, timeout=120).json()
        assert [c["text"] for c in got["choices"]] == [c["text"] for c in want["choices"]]
        assert _pd(fleet)["ok"] == before["ok"] + 1
        per_prompt = got["usage"]["prompt_tokens"] // (1 if isinstance(prompt, str) else 2)
        assert got["usage"]["prompt_tokens_details"]["cached_tokens"] >= (per_prompt - 16) // 16 * 16


def test_fleet_metrics_and_console_show_the_hand_overs(servers: tuple[TripodProcess, ServerProcess]) -> None:
    fleet, _ = servers
    assert _metric(fleet.url, "tripod:router_pd_transfers_total", 'outcome="ok"') >= 5
    assert _metric(fleet.url, "tripod:router_pd_transfer_seconds_count") >= 5
    f = fleet.wait_for("the replicas' transfer counters scraped", lambda f: all(
        r["counters"].get("pd_kv_sent_bytes" if r["role"] == "prefill" else "pd_kv_received_bytes", 0) > 0
        for r in f["replicas"]), 30)
    assert f["pd"]["ok"] >= 4 and f["pd"]["bytes"] > 0 and f["pd"]["seconds"] > 0
    decode = next(r for r in f["replicas"] if r["role"] == "decode")
    assert decode["kv_tier"] and decode["counters"]["tier_hits/disk"] > 0  # the handed-over blocks, loaded
    ui = httpx.get(f"{fleet.url}/ui/api/fleet", timeout=10).json()
    nodes = {n["role"]: n for n in ui["nodes"]}
    assert nodes["prefill"]["kv_sent_bytes"] > 0 and nodes["decode"]["kv_received_bytes"] > 0
    assert nodes["decode"]["tier_hits_disk"] > 0 and ui["pd"]["ok"] >= 4


def test_a_prefill_replica_killed_mid_transfer_costs_a_fallback(
        servers: tuple[TripodProcess, ServerProcess], marker: Path) -> None:
    fleet, ref = servers
    assert not marker.exists(), "the kill hook fired before the long prompt"
    decode = _decode_url(fleet)
    cut_before = _metric(decode, "tripod:pd_kv_receives_total", 'outcome="cut"')
    blocks_before = _metric(decode, "tripod:pd_kv_received_blocks_total")
    msgs = [{"role": "system", "content": _system("kill", repeat=4)}, {"role": "user", "content": "Which bay?"}]
    before = _pd(fleet)
    got = _chat(fleet.url, messages=msgs, temperature=0, max_tokens=12)
    assert marker.exists(), "the prefill replica was killed mid-transfer"
    want = _chat(ref.url, messages=msgs, temperature=0, max_tokens=12)
    assert got.choices[0].message.content == want.choices[0].message.content
    assert got.usage.prompt_tokens > (KILL_AFTER + 2) * 16
    after = _pd(fleet)
    assert after["fallback"] == before["fallback"] + 1 and after["ok"] == before["ok"], after
    # The decode replica kept the whole blocks it had verified before the cut, and served every one:
    # the request waited for the cut stream to end (server/api/pd.py HandOverGate). (How many of the
    # KILL_AFTER blocks sent reach it depends on what its server had read when the connection died.)
    assert cut_before == 0 and _metric(decode, "tripod:pd_kv_receives_total", 'outcome="cut"') == 1
    received = _metric(decode, "tripod:pd_kv_received_blocks_total") - blocks_before
    assert 1 <= received <= KILL_AFTER
    assert got.usage.prompt_tokens_details.cached_tokens >= received * 16
    # The supervisor brings the prefill replica back; the next long prompt is handed over again.
    fleet.wait_for("the prefill replica back", lambda f: any(
        r["role"] == "prefill" and r["state"] == "healthy" and r["restarts"] >= 1 for r in f["replicas"]), 120)
    msgs[0]["content"] = _system("after-kill", repeat=4)
    again = _chat(fleet.url, messages=msgs, temperature=0, max_tokens=12)
    assert again.choices[0].message.content == _chat(ref.url, messages=msgs, temperature=0,
                                                     max_tokens=12).choices[0].message.content
    assert _pd(fleet)["ok"] == after["ok"] + 1


def test_bad_hand_overs_get_clear_errors(servers: tuple[TripodProcess, ServerProcess]) -> None:
    """Another model's blocks (409), bytes that are no blocks (400), a replica with no tier to receive
    into (409) and a malformed order (400), each in the OpenAI error shape."""
    from tripod.memory.kv_blocks import TierLayout, chain_keys, encode_block

    fleet, ref = servers
    decode = _decode_url(fleet)
    other = TierLayout(bytes(16), 30, (2, 3, 64), torch.float32, 16)  # another identity
    tokens = list(range(16))
    block = encode_block(other, chain_keys(bytes(16), tokens, 16)[0], tokens, torch.zeros(other.shape))
    cases = [(decode, "/v1/pd/kv", block, 409, "identity"), (decode, "/v1/pd/kv", b"x" * 100, 400, "not a stream"),
             (ref.url, "/v1/pd/kv", block, 409, "no disk tier"),
             (decode, "/v1/pd/prefill", b'{"path": "/v1/embeddings", "body": {}, "decode_url": "x"}', 400, "order")]
    for url, path, body, status, words in cases:
        r = httpx.post(url + path, content=body, timeout=30)
        assert r.status_code == status, (path, r.text)
        assert words in r.json()["error"]["message"], r.text
    assert _metric(decode, "tripod:pd_kv_receives_total", 'outcome="refused"') == 2


@pytest.mark.parametrize("argv, words", [
    (("--role", "decode", "--no-prefix-cache"), "cannot be combined with --no-prefix-cache"),
    (("--replicas", "1", "--prefill-replicas", "1", "--max-replicas", "3"), "autoscaling a disaggregated fleet"),
    (("--replicas", "2", "--role", "decode"), "a fleet gives its replicas their roles"),
    (("--prefill-replicas", "1", "--tensor-parallel-size", "2"), "not built for a model over several processes"),
])
def test_combinations_that_cannot_work_are_refused(argv: tuple[str, ...], words: str) -> None:
    r = subprocess.run([sys.executable, "-m", "tripod.cli", "serve", "--port", "0", *argv], capture_output=True,
                       text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 2 and words in r.stderr, r.stderr
