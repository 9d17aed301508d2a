"""Exact ties in every selecting top-k of a model, built on purpose: the V3.2 lightning indexer's
and V4's CSA indexer's scores all 0.0 (their head weights zeroed), MoE routers whose experts score
the same (a zeroed gate, or two experts with one gate row). With ties broken by position (the
lowest index wins: ``layers/topk.py``) a request's greedy tokens are the same alone, batched,
chunked (chunks of 5 against 64) and from the prefix cache. (Not compared with transformers: its
``torch.topk`` leaves ties unspecified, which is what this fixes.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.tiny_models import VOCAB, build_hf, save
from tripod import Engine, SamplingParams

N_TOKENS = 12


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    a = torch.randint(3, VOCAB, (41,), generator=g).tolist()
    b = torch.randint(3, VOCAB, (23,), generator=g).tolist()
    c = a[:29] + torch.randint(3, VOCAB, (6,), generator=g).tolist()  # shares a's first 29 tokens
    return [a, b, c]


PROMPTS = _prompts()


def _tied(kind: str) -> Any:
    """The tiny model with its indexer scores all zero and its routers tied."""
    model = build_hf(kind)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if "indexer" in name and "weights_proj" in name:
                p.zero_()  # every indexer score exactly 0.0: all keys tie
            elif name.endswith("mlp.gate.weight") and ".layers.1." in name:
                p.zero_()  # every expert of layer 1 scores the same
            elif name.endswith("mlp.gate.weight") and p.ndim == 2:
                p[2].copy_(p[0])  # experts 0 and 2 tie everywhere in the other layers
            elif name.endswith("e_score_correction_bias"):
                p.zero_()
    return model


@pytest.mark.parametrize("kind", ["deepseek-v32", "deepseek-v4", "qwen3-moe"])
def test_tied_selections_alone_batched_chunked_cached(kind: str, tmp_path: Path, hf_tokenizer: Any) -> None:
    folder = save(_tied(kind), tmp_path / kind, hf_tokenizer)
    greedy = SamplingParams(max_tokens=N_TOKENS, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=N_TOKENS, temperature=1.0, top_k=3, seed=5, ignore_eos=True)

    def engine(chunk: int) -> Engine:
        return Engine(model=str(folder), dtype="float32", kv_cache_tokens=2048, chunk_size=chunk, max_running=4,
                      kernels="eager")

    whole = engine(64)
    alone = [whole.generate([p], greedy)[0].token_ids for p in PROMPTS]  # c's prefix is a's: a hit
    assert whole.stats.cached_prompt_tokens >= 29
    assert [o.token_ids for o in whole.generate(PROMPTS, greedy)] == alone, "batched (and cached) differ from alone"
    seeded = [whole.generate([p], sampled)[0].token_ids for p in PROMPTS]
    assert [o.token_ids for o in whole.generate(PROMPTS, sampled)] == seeded, "seeded top-k sampling: batched differs"
    chunked = engine(5)
    assert [chunked.generate([p], greedy)[0].token_ids for p in reversed(PROMPTS)] == alone[::-1], "chunked differ"
    assert [o.token_ids for o in chunked.generate(PROMPTS, sampled)] == seeded
    whole.assert_consistent()
    chunked.assert_consistent()
