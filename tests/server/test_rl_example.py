"""examples/rl/grpo.py: a few GRPO steps with tripod serving the rollouts and the weights pushed over
a gloo group after each step. After every push tripod's greedy tokens equal the trainer's model and
their logprobs match its float32 forward; a rollout is the same alone and batched."""

from __future__ import annotations

from pathlib import Path

import pytest

from examples.rl.grpo import grpo


@pytest.mark.slow  # (a server, and a trainer's forward and backward passes per step)
def test_grpo_loop(tmp_path: Path) -> None:
    report = grpo(steps=2, group=4, workdir=tmp_path)
    assert [r["weight_version"] for r in report] == [1, 2]
    for r in report:
        assert r["greedy_tokens_equal"] and r["batch_invariant"]
        assert r["max_logprob_diff"] < 1e-4  # (the kernels' float32 sums against torch's: rounding only)
