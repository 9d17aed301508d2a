"""The noisy-neighbour benchmark (``benchmarks/noisy_neighbour_http.py``), bounded, as a test: a real
``tripod serve --tenants`` on the embedded model; tenant A floods at 10x the measured capacity
(allowed every running slot, so only the engine's fair preemption keeps B from waiting behind it),
tenant B sends a steady load well under its share: B sees zero errors and A's refusals are 429s
naming its limit; then both backlogged at weights 1:1 and 3:1 get output-token shares within 10 %
of their weights. (Slow: CI runs it with TRIPOD_SLOW=1.)

B's TTFT p99 against its value alone (the issue's ×1.3) is a latency on a shared machine: the
benchmark measures and records it (``benchmarks/results/noisy_neighbour.md``); this test prints it
and asserts what makes it small — B never waits behind A (``tests/engine/test_fair_share.py``
asserts the same in scheduler steps)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from noisy_neighbour_http import Server, noisy, shares, tenants_file

MAX_RUNNING = 4


def _args(**kw: float) -> argparse.Namespace:
    base = dict(max_running=MAX_RUNNING, threads=1, max_tokens=16, calibrate=4.0, seconds=8.0, warmup=3.0,
                flood=10.0, b_share=0.25, b_words=0)
    return argparse.Namespace(**{**base, **kw})


@pytest.mark.slow
def test_noisy_neighbour_b_unharmed_and_shares_by_weight(tmp_path: Path) -> None:
    tenants = tmp_path / "tenants.toml"
    tenants_file(tenants, (1.0, 1.0), {"max_concurrent": MAX_RUNNING})
    srv = Server(tmp_path, tenants, MAX_RUNNING, 1)
    try:
        r = asyncio.run(noisy(srv.url, _args()))
    finally:
        srv.stop()
    print(r)
    assert r["b_alone"]["errors"] == 0 and r["b_with_flood"]["errors"] == 0, r
    assert r["b_with_flood"]["requests"] > 0
    refused = r["a_statuses"].get("429", 0)
    assert refused > 0 and r["a_429_limits_named"] == {"max_concurrent": refused}, r
    assert r["a_429_example"] == f"tenant 'a' is over its max_concurrent ({MAX_RUNNING})"
    for weights in ((1.0, 1.0), (3.0, 1.0)):
        tenants_file(tenants, weights, {})
        srv = Server(tmp_path, tenants, MAX_RUNNING, 1)
        try:
            s = asyncio.run(shares(srv.url, _args(), weights))
        finally:
            srv.stop()
        print(s)
        assert s["errors"] == 0
        assert abs(s["share_a"] - s["expected_share_a"]) <= 0.1 * s["expected_share_a"], s
