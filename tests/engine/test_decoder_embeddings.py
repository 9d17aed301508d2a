"""A decoder as an embedder (``--task embed``, ``engine/pooling.py``): the pooled final hidden
states equal Hugging Face's ``AutoModel(ids).last_hidden_state`` (float32, pooled the same way) to
1e-5, each input alone, all batched, and with prefill chunks shorter than the prompts (mean pooling
then sums over several steps); nothing is sampled and no KV is kept after."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.support.tiny_models import VOCAB, build_hf, save
from tripod import Engine
from tripod.engine.embed_queue import EmbedQueue

G = torch.Generator().manual_seed(11)
INPUTS = [torch.randint(3, VOCAB, (n,), generator=G).tolist() for n in (37, 6, 1, 20)]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory, hf_tokenizer: Any) -> dict[str, Path]:
    return {kind: save(build_hf(kind), tmp_path_factory.mktemp(kind), hf_tokenizer) for kind in ("qwen3", "llama")}


def reference(folder: Path, how: str, normalize: bool) -> list[torch.Tensor]:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(folder), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids in INPUTS:
            h = model(torch.tensor([ids])).last_hidden_state[0]
            v = {"last": h[-1], "mean": h.mean(0), "cls": h[0]}[how]
            out.append(F.normalize(v, dim=-1) if normalize else v)
    return out


def check(got: list[list[float]], want: list[torch.Tensor], what: str) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        diff = (torch.tensor(g) - w).abs().max().item()
        assert diff < 1e-5, f"{what}: input {i} differs from transformers' by {diff}"


@pytest.mark.parametrize(("kind", "how", "normalize", "kernels"), [
    ("qwen3", "last", True, "eager"), ("qwen3", "mean", False, "eager"), ("llama", "cls", False, "eager"),
    ("llama", "mean", True, "eager"), ("qwen3", "mean", True, "optimized")])
def test_pooled_states_equal_transformers(kind: str, how: str, normalize: bool, kernels: str,
                                          folders: dict[str, Path]) -> None:
    want = reference(folders[kind], how, normalize)
    # chunk 8 and 16 tokens a step: the 37-token prompt takes 5 steps, pooled across them
    eng = Engine(model=str(folders[kind]), dtype="float32", kv_cache_tokens=1024, chunk_size=8, max_batch_tokens=16,
                 max_running=4, task="embed", pooling=how, normalize=normalize, kernels=kernels)
    q = EmbedQueue(eng)
    for i, ids in enumerate(INPUTS):
        check(q.embed([ids]), [want[i]], f"{kind}/{how} input {i} alone")
    before = eng.stats.steps
    check(q.embed(INPUTS), want, f"{kind}/{how} batched, chunked")
    assert eng.stats.steps - before < sum(-(-len(x) // 8) for x in INPUTS), "the inputs were not batched"
    assert eng.stats.generated_tokens == 0, "an embedding request sampled a token"
    assert not eng.pending and not eng.scheduler.running
    assert eng.pool.allocator.num_free == eng.pool.allocator.num_slots, "KV kept after pooling"
    eng.assert_consistent()


def test_a_refused_input_answers_the_whole_request(folders: dict[str, Path]) -> None:
    eng = Engine(model=str(folders["qwen3"]), dtype="float32", kv_cache_tokens=256, max_model_len=64,
                 task="embed", pooling="last")
    q = EmbedQueue(eng)
    with pytest.raises(ValueError, match="input\\[1\\]"):
        q.embed([[5, 6], [7] * 100])
    outs, replies = q.collect(eng.step())  # the first input, aborted, is reported once, to nobody
    assert not outs and not replies
    assert not eng.pending and eng.pool.allocator.num_free == eng.pool.allocator.num_slots
    assert len(q.embed([[5, 6]])[0]) == 64
    with pytest.raises(AssertionError, match="generates nothing"):  # (a server refuses it before: 400)
        eng.generate([[5, 6]])
