"""Prefill/decode disaggregation of a hybrid model (tiny random Qwen3.5) end to end: ``tripod serve
--replicas 1 --prefill-replicas 1`` hands the prompt's KV *and its state snapshot* to the decode
replica, which resumes the request from it (``cached_tokens`` = the prompt but its last token) and
answers with transformers' greedy tokens (the logprobs, bit for bit against one engine, are
tests/models/test_hybrid_disk.py's)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from openai import OpenAI

from tests.conftest import HFReference, check_greedy_tokens
from tests.models.test_hybrid_gdn import VOCAB, build_qwen3_5
from tests.support.server_helpers import TripodProcess
from tests.support.tiny_models import save

pytestmark = pytest.mark.slow  # a disaggregated fleet

N = 8


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, hf_tokenizer: Any) -> Iterator[tuple[TripodProcess, HFReference]]:
    model = build_qwen3_5()
    tmp = tmp_path_factory.mktemp("pd_hybrid")
    folder = save(model, tmp / "model", hf_tokenizer)
    args = ("--model", str(folder), "--dtype", "float32", "--kernels", "optimized", "--kv-cache-tokens", "4096")
    fl = TripodProcess(tmp, "serve", "--replicas", "1", "--prefill-replicas", "1", *args, "--health-interval", "0.2",
                       "--replica-log-dir", str(tmp), start_timeout=600)
    fl.wait_for("a healthy prefill and decode replica",
                lambda f: sorted(r["role"] for r in f["replicas"] if r["state"] == "healthy") == ["decode", "prefill"],
                60)
    yield fl, HFReference(model)
    fl.stop()


def _complete(url: str, prompt: list[int]) -> Any:
    oai = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    return oai.completions.create(model=oai.models.list().data[0].id, prompt=prompt, max_tokens=N, temperature=0,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})


def test_a_decode_replica_resumes_a_hybrid_from_the_handed_over_snapshot(
        fleet: tuple[TripodProcess, HFReference]) -> None:
    fl, hf = fleet
    prompt = torch.randint(3, VOCAB, (150,), generator=torch.Generator().manual_seed(3)).tolist()
    before = dict(fl.fleet()["pd"])
    got = _complete(fl.url, prompt)
    assert dict(fl.fleet()["pd"])["ok"] == before["ok"] + 1, "the prompt was handed over"
    assert got.usage.prompt_tokens_details.cached_tokens == len(prompt) - 1, "resumed from the snapshot"
    tokens = got.choices[0].model_extra["token_ids"]
    check_greedy_tokens(tokens, hf.greedy(prompt, N), "decode replica after the hand-over")
