"""The chaos run (benchmarks/failover_chaos.py), bounded: a fleet of 3 replicas under steady
streaming load for 90 s while a replica's server or engine process is SIGKILLed every
12 s (the recorded run, benchmarks/results/failover_chaos.md, is longer). Every request completes,
every greedy answer equals its undisturbed reference, no stream
carries an error, and no continuation runs out of budget. (Slow: CI runs it with TRIPOD_SLOW=1.)"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from failover_chaos import markdown, run


@pytest.mark.slow
def test_chaos_every_answer_completes_unchanged(tmp_path: Path) -> None:
    r = run(duration=90, replicas=3, concurrency=3, kill_every=12, max_tokens=48, log_dir=tmp_path)
    print(markdown(r))
    assert r.requests > 10
    assert r.kills_server + r.kills_engine >= 4
    assert r.errors == 0 and r.mismatches == 0, r.error_samples
    assert r.completed == r.requests
    assert r.continuations.get("ok", 0) >= 1 and r.continuations.get("exhausted", 0) == 0, r.continuations
