"""Failover continuation through prefill/decode disaggregation (slow: a fleet of three replicas).
``tripod serve --replicas 2 --prefill-replicas 1``: a streamed greedy answer whose prompt was handed
over by the prefill replica; its decode replica is SIGKILLed mid-stream; the router continues the
answer on the other decode replica, and the client's text equals a single replica's answer."""

from __future__ import annotations

import json
import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.server_helpers import TripodProcess

ARGS = ("--dtype", "float32", "--kernels", "optimized", "--kv-cache-tokens", "8192")
SYSTEM = "You are the depot's dispatcher. " + ("Fragile parcels ride in the front cage; cold goods in blue boxes. " * 6)
CUT_AFTER = 6  # content chunks the client has before the kill


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TripodProcess]:
    tmp: Path = tmp_path_factory.mktemp("pd-failover")
    f = TripodProcess(tmp, "serve", "--replicas", "2", "--prefill-replicas", "1", *ARGS, "--health-interval", "0.2",
                      "--replica-log-dir", str(tmp))
    f.wait_for("three healthy replicas", lambda v: sorted(r["role"] for r in v["replicas"] if r["state"] == "healthy")
               == ["decode", "decode", "prefill"], 120)
    yield f
    f.stop()


def _metric(url: str, name: str, label: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(m.group(2)) for m in re.finditer(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", text, re.M)
               if label in (m.group(1) or ""))


@pytest.mark.slow
def test_a_decode_replica_killed_mid_answer_is_continued_elsewhere(fleet: TripodProcess) -> None:
    body = {"model": "default", "max_tokens": 40, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Tell me about bay four."}]}
    prefill = next(r for r in fleet.fleet()["replicas"] if r["role"] == "prefill")
    want = httpx.post(prefill["url"] + "/v1/chat/completions", json=body, timeout=120).json()  # a single replica
    text: list[str] = []
    with httpx.stream("POST", fleet.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        serving = r.headers["x-tripod-replica"]
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            for c in event["choices"]:
                text.append(c["delta"].get("content") or "")
            if len(text) == CUT_AFTER:
                rep = next(x for x in fleet.fleet()["replicas"] if x["name"] == serving)
                assert rep["role"] == "decode"
                os.kill(rep["pid"], signal.SIGKILL)
    assert "".join(text) == want["choices"][0]["message"]["content"]
    assert fleet.fleet()["pd"]["ok"] >= 1
    assert _metric(fleet.url, "tripod:router_continuations_total", 'outcome="ok"') >= 1
