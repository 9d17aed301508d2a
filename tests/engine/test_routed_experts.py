"""Routed experts per token (``return_routed_experts``, engine/routed_experts.py): the top-k expert
ids of every MoE layer at every position a request computed equal transformers' router top-k for
the same tokens (fp32), are the same alone and batched (and chunked), never come from the prefix
cache, and a dense model refuses the request."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.tiny_models import VOCAB, build_hf, save
from tripod import Engine, SamplingParams


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    a = torch.randint(3, VOCAB, (19,), generator=g).tolist()
    b = torch.randint(3, VOCAB, (7,), generator=g).tolist()
    return [a, b, a[:12] + b[:3]]  # the third shares a's first 12 tokens (a prefix-cache hit otherwise)


def _hf_topk(model: Any, ids: list[int]) -> list[list[list[int]]]:
    """transformers' router top-k at every position of ``ids``: per position, per MoE layer."""
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_router_logits=True)
    k = model.config.num_experts_per_tok
    per_layer = [logits.reshape(len(ids), -1).float().topk(k, dim=-1).indices for logits in out.router_logits]
    return torch.stack(per_layer, dim=1).tolist()


@pytest.mark.parametrize("kind", ["qwen3-moe", "mixtral"])
def test_routed_experts_match_transformers_alone_and_batched(kind: str, tmp_path: Path, hf_tokenizer: Any) -> None:
    hf = build_hf(kind)
    folder = save(hf, tmp_path / kind, hf_tokenizer)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, return_routed_experts=True)
    prompts = _prompts()

    whole = Engine(model=str(folder), dtype="float32", kv_cache_tokens=1024, max_running=4, kernels="eager")
    alone = [whole.generate([p], params)[0] for p in prompts]  # the third would hit a's cached prefix
    batched = whole.generate(prompts, params)
    chunked = Engine(model=str(folder), dtype="float32", kv_cache_tokens=1024, max_running=4, kernels="eager",
                     chunk_size=5).generate(prompts, params)

    n_moe = sum(1 for m in hf.modules() if type(m).__name__.endswith("SparseMoeBlock"))
    for p, a, b, c in zip(prompts, alone, batched, chunked, strict=True):
        computed = p + a.token_ids[:-1]
        assert a.routed_experts is not None and len(a.routed_experts) == len(computed)
        assert all(len(pos) == n_moe and all(len(ids) == 2 for ids in pos) for pos in a.routed_experts)
        assert a.routed_experts == _hf_topk(hf, computed)
        assert a.cached_tokens == 0  # routed here, not taken from the prefix cache
        assert b.token_ids == a.token_ids and b.routed_experts == a.routed_experts
        assert c.token_ids == a.token_ids and c.routed_experts == a.routed_experts


def test_routed_experts_not_asked_not_returned_and_dense_refused(tmp_path: Path, hf_tokenizer: Any) -> None:
    moe = save(build_hf("qwen3-moe"), tmp_path / "moe", hf_tokenizer)
    out = Engine(model=str(moe), dtype="float32", kv_cache_tokens=512, kernels="eager").generate(
        [[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0.0))[0]
    assert out.routed_experts is None
    dense = save(build_hf("llama"), tmp_path / "dense", hf_tokenizer)
    engine = Engine(model=str(dense), dtype="float32", kv_cache_tokens=512, kernels="eager")
    with pytest.raises(ValueError, match="mixture-of-experts"):
        engine.generate([[5, 6, 7]], SamplingParams(max_tokens=2, return_routed_experts=True))
