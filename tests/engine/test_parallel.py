"""One model over several processes gives the single process's outputs: tensor parallel
(``--tensor-parallel-size``: each rank 1/T of every layer and its own KV pool) and pipeline parallel
(``--pipeline-parallel-size``: each stage a contiguous share of the layers and their KV).

Tiny random checkpoints (``tests/support/tiny_models.py``), fp32: greedy tokens of TP=2 equal the
single-process tokens (a divergence only at a near tie of the single-process run, as the other
parity tests allow) alone, batched with radix-cache hits, with chunked prefill shorter than the
prompts; seeded sampling equal too; each rank holds about half of the weights (the sharding is
real). A dense GQA family, a MoE split by columns and by experts (``--enable-expert-parallel``) and
DeepSeek-V3 (MLA split by heads, latent replicated) run by default; the other families are `slow`.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import Greedy, check_greedy_tokens
from tests.support.tiny_models import VOCAB, build_hf, save
from tripod import Engine, SamplingParams
from tripod.engine.executor.group import weight_bytes
from tripod.layers.moe import MoE

N_TOKENS = 16


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    a = torch.randint(3, VOCAB, (45,), generator=g).tolist()
    b = torch.randint(3, VOCAB, (7,), generator=g).tolist()
    c = a[:33] + torch.randint(3, VOCAB, (6,), generator=g).tolist()  # shares a's first 33 tokens
    return [a, b, c]


PROMPTS = _prompts()
GREEDY = SamplingParams(max_tokens=N_TOKENS, temperature=0.0, ignore_eos=True, logprobs=2)
SEEDED = SamplingParams(max_tokens=N_TOKENS, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
SETTINGS: dict[str, Any] = dict(dtype="float32", kernels="eager", kv_cache_tokens=2048, chunk_size=16,
                                max_batch_tokens=64, max_running=8)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory, hf_tokenizer: Any) -> Any:
    made: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in made:
            made[kind] = save(build_hf(kind), tmp_path_factory.mktemp(kind), hf_tokenizer)
        return made[kind]

    return get


LAYOUTS = {"tp": "tensor_parallel_size", "pp": "pipeline_parallel_size", "dp": "data_parallel_size"}
SIZES: dict[str, dict[str, int]] = {k: {v: 2} for k, v in LAYOUTS.items()}
SIZES["tpxpp"] = {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}  # 4 ranks: 2 stages of TP=2


def _check(kind: str, path: Path, expert_parallel: bool, pipeline: bool = False, layout: str = "tp") -> None:
    layout = "pp" if pipeline else layout
    single = Engine(model=str(path), **SETTINGS)
    refs = [Greedy.from_tripod(single.generate([p], GREEDY)[0]) for p in PROMPTS]
    seeded = [o.token_ids for o in single.generate(PROMPTS, SEEDED)]
    full = weight_bytes(single.loaded.model)
    what = f"{kind} {layout.upper()}=2{' EP' if expert_parallel else ''}"
    sizes = SIZES[layout]
    tp = Engine(model=str(path), enable_expert_parallel=expert_parallel, **sizes, **SETTINGS)
    try:
        for i, p in enumerate(PROMPTS):  # alone (c's prefix is a's: already a radix hit)
            check_greedy_tokens(tp.generate([p], GREEDY)[0].token_ids, refs[i], f"{what} prompt {i} alone")
        cached = tp.stats.cached_prompt_tokens
        for i, out in enumerate(tp.generate(PROMPTS, GREEDY)):  # batched, every prefix cached
            check_greedy_tokens(out.token_ids, refs[i], f"{what} prompt {i} batched")
        assert tp.stats.cached_prompt_tokens > cached, "the batched run never hit the prefix cache"
        assert [o.token_ids for o in tp.generate(PROMPTS, SEEDED)] == seeded, f"{what}: seeded sampling differs"
        tp.assert_consistent()
        ranks = tp.ranks
        assert [r.rank for r in ranks] == list(range(tp.config.world_size))
        assert all(r.node == socket.gethostname() for r in ranks)  # spawned here
        assert tp.config.world_size == 2 ** len(sizes)
        assert sum(r.weight_bytes for r in ranks) >= full
        card = tp.runner.card()["parallel"]
        assert card.expert_parallel == expert_parallel
        if layout == "dp":  # each rank the KV of its own requests; the MoE/MLP and vocabulary split
            assert card.data_parallel_size == 2 and card.kv_capacity_tokens == 2 * ranks[0].kv_slots
            tp.generate(PROMPTS, GREEDY)  # two at once: both ranks hold a request's KV
            assert all(tree.size > 0 for tree in tp.cache.trees), f"{what}: a rank never held a request"
            moes = [layer.mlp for layer in tp.loaded.model.layers if isinstance(layer.mlp, MoE)]
            # expert parallel under DP attention: (token, expert) pairs go to the experts' ranks (all-to-all)
            assert moes and all(m.dispatch == expert_parallel for m in moes)
            assert all(r.weight_bytes < full for r in ranks)
            return
        if layout == "tpxpp":  # each rank half of its stage's layers: about a quarter of the model
            assert card.tensor_parallel_size == card.pipeline_parallel_size == 2
            assert tp.runner.micro_steps > 0, "the batched steps never ran as micro-batches"
            for r in ranks:
                assert r.weight_bytes <= 0.45 * full, f"{what}: rank {r.rank} holds {r.weight_bytes} of {full} bytes"
            return
        if pipeline:  # each stage its layers (and their KV); the embedding and head on every stage
            assert card.pipeline_parallel_size == 2
            assert tp.runner.micro_steps > 0, "the batched steps never ran as micro-batches"
            assert sum(r.kv_bytes_per_token for r in ranks) == single.kv_bytes_per_token
            assert all(r.weight_bytes < full for r in ranks)
            return
        assert card.tensor_parallel_size == 2
        for r in ranks:  # about half each: split, not copied (+ the replicated norms, router, latent, shared expert)
            assert r.weight_bytes <= 0.6 * full, f"{what}: rank {r.rank} holds {r.weight_bytes} of {full} bytes"
    finally:
        tp.close()


@pytest.mark.parametrize(("kind", "expert_parallel"), [("llama", False), ("qwen2-moe", True), ("deepseek-v3", False)])
def test_tp2_equals_one_process(kind: str, expert_parallel: bool, folder: Any) -> None:
    _check(kind, folder(kind), expert_parallel)


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "expert_parallel"), [
    ("qwen3", False), ("gemma3", False), ("mistral-sliding", False), ("mixtral", False), ("mixtral", True),
    ("qwen2-moe", False), ("qwen3-moe", False), ("deepseek-v2", False), ("deepseek-v3", True),
])
def test_tp2_equals_one_process_every_family(kind: str, expert_parallel: bool, folder: Any) -> None:
    _check(kind, folder(kind), expert_parallel)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "deepseek-v3"])
def test_pp2_equals_one_process(kind: str, folder: Any) -> None:
    _check(kind, folder(kind), False, pipeline=True)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gemma3", "mixtral", "qwen3-moe", "mistral-sliding"])
def test_pp2_equals_one_process_every_family(kind: str, folder: Any) -> None:
    _check(kind, folder(kind), False, pipeline=True)


@pytest.mark.slow
def test_tp2_by_pp2_equals_one_process(folder: Any) -> None:
    """Tensor parallel inside each pipeline stage: 4 ranks, two stages of two lanes."""
    _check("qwen3", folder("qwen3"), False, layout="tpxpp")


@pytest.mark.slow
@pytest.mark.parametrize("expert_parallel", [False, True])
def test_dp_attention2_equals_one_process(expert_parallel: bool, folder: Any) -> None:
    """``--data-parallel-size 2`` on DeepSeek-V3 (MLA + MoE): each rank runs its own requests'
    attention over its own latent pool; the MoE (split by columns, or by experts) sees every token."""
    _check("deepseek-v3", folder("deepseek-v3"), expert_parallel, layout="dp")


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "layout"), [("llama", "tp"), ("deepseek-v3", "dp")])
def test_tp2_prompt_logprobs_and_ngram_speculation(kind: str, layout: str, folder: Any) -> None:
    """The passes outside the plain step reach the workers too: prompt scoring's own forward, and
    the verify rows of n-gram drafts (a repetitive prompt, so drafts are proposed and verified)."""
    path = folder(kind)
    # a repetitive prompt whose greedy continuation (of this random model) repeats it: drafts found
    rep = (PROMPTS[0][:12] * 4)[:44] if kind == "llama" else (PROMPTS[0][:6] * 10)[:40]
    scored = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    single = Engine(model=str(path), **SETTINGS)
    want_scores = single.generate([PROMPTS[0]], scored)[0].prompt_logprobs
    want_spec = Greedy.from_tripod(single.generate([rep], GREEDY)[0])
    tp = Engine(model=str(path), **{LAYOUTS[layout]: 2}, speculative="ngram", **SETTINGS)
    try:
        got = tp.generate([PROMPTS[0]], scored)[0].prompt_logprobs
        assert got is not None and want_scores is not None and len(got) == len(want_scores)
        for g, w in zip(got[1:], want_scores[1:], strict=True):
            assert g is not None and w is not None and g.token_id == w.token_id
            assert abs(g.logprob - w.logprob) < 1e-4
        check_greedy_tokens(tp.generate([rep], GREEDY)[0].token_ids, want_spec, f"{layout}=2 with ngram drafts")
        assert tp.stats.spec["ngram"].drafts > 0, "no n-gram draft was verified: the test proves nothing"
    finally:
        tp.close()


@pytest.mark.slow
def test_what_tensor_parallel_refuses(folder: Any) -> None:
    """Shapes T does not divide, and what does not run sharded yet, are refused with what to change."""
    with pytest.raises(ValueError, match="tensor parallel size 3 must divide the number of attention heads"):
        Engine(model=str(folder("llama")), tensor_parallel_size=3, **SETTINGS)
    with pytest.raises(ValueError, match="--speculative ngram only"):
        Engine(model=str(folder("llama")), tensor_parallel_size=2, speculative="self:1", **SETTINGS)
    with pytest.raises(ValueError, match="--enable-expert-parallel splits experts"):
        Engine(model=str(folder("llama")), enable_expert_parallel=True, **SETTINGS)
    with pytest.raises(ValueError, match="pipeline parallel size 4 exceeds the model's 3 layers"):
        Engine(model=str(folder("llama")), pipeline_parallel_size=4, **SETTINGS)
    with pytest.raises(ValueError, match="MLA models"):
        Engine(model=str(folder("llama")), data_parallel_size=2, **SETTINGS)
    with pytest.raises(ValueError, match="combining it with --tensor-parallel-size"):
        Engine(model=str(folder("deepseek-v3")), data_parallel_size=2, tensor_parallel_size=2, **SETTINGS)
