"""A hybrid (Gated DeltaNet + attention) model through a real ``tripod serve --model DIR``: a tiny
random Qwen3.5 checkpoint saved by transformers, driven with the official ``openai`` client.

Greedy completions carry transformers' tokens (float32); an agent's next turn — the first turn's
prompt + answer + new text — resumes from the state snapshot the first turn left on the prefix
cache (``usage.prompt_tokens_details.cached_tokens`` = all but the answer's last token) and still
carries transformers' tokens; ``/metrics`` and ``/debug/engine`` show the state pool sized by
``--max-state-slots`` / ``--max-state-snapshots``; a flag the hybrid cannot run exactly makes
``tripod serve`` exit non-zero with the reason."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from tests.conftest import HFReference, check_greedy_tokens
from tests.models.test_hybrid_gdn import VOCAB, build_qwen3_5
from tests.support.server_helpers import ServerProcess, metric_sum
from tests.support.tiny_models import save

N = 12  # tokens per answer
SLOTS, SNAPSHOTS = 2, 6


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory, hf_tokenizer: Any) -> tuple[Path, HFReference]:
    model = build_qwen3_5()
    folder = save(model, tmp_path_factory.mktemp("qwen3_5_serve"), hf_tokenizer)
    return folder, HFReference(model)


def _wait_metric(url: str, name: str, want: float, timeout: float = 30.0) -> float:
    """The metric once it reaches ``want`` (the server learns the engine's numbers from its heartbeat)."""
    deadline = time.monotonic() + timeout
    while (got := metric_sum(url, name)) < want and time.monotonic() < deadline:
        time.sleep(0.1)
    return got


def test_served_hybrid_matches_transformers_and_resumes_the_next_turn(
        checkpoint: tuple[Path, HFReference], tmp_path: Path) -> None:
    folder, ref = checkpoint
    g = torch.Generator().manual_seed(11)
    first = torch.randint(3, VOCAB, (30,), generator=g).tolist()
    follow_up = torch.randint(3, VOCAB, (9,), generator=g).tolist()
    srv = ServerProcess(tmp_path, "--model", str(folder), "--kernels", "eager", "--max-running", "4",
                        "--max-state-slots", str(SLOTS), "--max-state-snapshots", str(SNAPSHOTS))
    try:
        oai = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120)
        card = oai.models.list().data[0]
        assert card.model_extra["architecture"] == "Qwen3_5ForCausalLM"

        def complete(prompt: list[int]) -> Any:
            return oai.completions.create(model=card.id, prompt=prompt, max_tokens=N, temperature=0,
                                          extra_body={"ignore_eos": True, "return_token_ids": True})

        r1 = complete(first)
        answer = r1.choices[0].model_extra["token_ids"]
        check_greedy_tokens(answer, ref.greedy(first, N), "turn 1")
        assert not (r1.usage.prompt_tokens_details and r1.usage.prompt_tokens_details.cached_tokens)
        # The next turn extends the first exactly: it resumes where the first request stopped (the
        # answer's last token was sampled, never run through the model).
        second = first + answer + follow_up
        r2 = complete(second)
        assert r2.usage.prompt_tokens == len(second)
        assert r2.usage.prompt_tokens_details.cached_tokens == len(first) + N - 1
        check_greedy_tokens(r2.choices[0].model_extra["token_ids"], ref.greedy(second, N), "turn 2 (from the cache)")

        stats = srv.wait_idle()["states"]
        assert (stats["slots"], stats["free"], stats["snapshot_slots"]) == (SLOTS, SLOTS, SNAPSHOTS)
        assert stats["snapshots_restored"] >= 1 and stats["snapshots_held"] >= 1
        assert _wait_metric(srv.url, "tripod:state_snapshots_restored_total", 1) >= 1
        assert metric_sum(srv.url, "tripod:state_slots") == SLOTS
        assert metric_sum(srv.url, "tripod:state_slots_free") == SLOTS
        assert metric_sum(srv.url, "tripod:state_snapshot_slots") == SNAPSHOTS
        held = metric_sum(srv.url, "tripod:state_snapshots_held")
        assert held >= 1
        assert metric_sum(srv.url, "tripod:state_snapshot_bytes") == held * stats["bytes_per_slot"] > 0
    finally:
        srv.stop()


@pytest.mark.slow  # (moved out of the default run: CI runs it)
def test_serve_refuses_what_a_hybrid_cannot_run(checkpoint: tuple[Path, HFReference]) -> None:
    """``--speculative mtp`` on a hybrid (its MTP layers are not loaded): ``tripod serve`` exits non-zero
    at start, saying why and what to use instead."""
    folder, _ = checkpoint
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRIPOD_API_KEY": ""}
    done = subprocess.run([sys.executable, "-m", "tripod.cli", "serve", "--model", str(folder), "--port", "0",
                           "--dtype", "float32", "--threads", "1", "--speculative", "mtp"],
                          capture_output=True, text=True, env=env, timeout=180)
    assert done.returncode != 0
    assert "--speculative mtp" in done.stdout + done.stderr
    assert "is not supported on hybrid linear-attention models" in done.stdout + done.stderr
