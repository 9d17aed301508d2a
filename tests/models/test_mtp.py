"""``--speculative mtp``: DeepSeek-V3's multi-token-prediction module as the draft.

A tiny random DeepSeek-V3 with an MTP module (its decoder block transformers' own) serves with
and without MTP drafts: the outputs are identical (greedy and seeded sampling: speculation is
lossless), drafts are proposed and verified, and every first draft token is what the module
predicts from the target's own hidden states over the whole sequence (an independent pass).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.tiny_models import VOCAB, add_mtp, add_v4_mtp, build_hf, save
from tripod import Engine, SamplingParams
from tripod.engine.speculative.mtp import MTPProposer


def _with_mtp(kind: str, tmp_path_factory: pytest.TempPathFactory, tokenizer: Any) -> Path:
    target = build_hf(kind, seed=5)
    out = save(target, tmp_path_factory.mktemp(f"{kind}-mtp"), tokenizer)
    add_mtp(target, out)
    return out


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory, hf_tokenizer: Any) -> Path:
    return _with_mtp("deepseek-v3", tmp_path_factory, hf_tokenizer)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (9, 26)]


def _engine(folder: Path, **kw: Any) -> Engine:
    return Engine(model=str(folder), dtype="float32", kv_cache_tokens=4096, chunk_size=16, **kw)


def test_mtp_drafts_are_lossless(folder: Path) -> None:
    _check_lossless(folder)


def test_mtp_drafts_on_deepseek_v32(tmp_path_factory: pytest.TempPathFactory, hf_tokenizer: Any) -> None:
    """V3.2's MTP module is a V3.2 block (its own lightning indexer, its key in the module's pool
    row): drafts from it are verified losslessly, with prompts longer than ``index_topk``."""
    _check_lossless(_with_mtp("deepseek-v32", tmp_path_factory, hf_tokenizer))


def test_mtp_drafts_on_deepseek_v4(tmp_path_factory: pytest.TempPathFactory, hf_tokenizer: Any) -> None:
    """V4's MTP block (``mtp.0.*``: a V4 block over the target's hidden *streams*, its own stream
    collapse) drafts, and the drafts are verified losslessly; prompts cross the compressed blocks."""
    target = build_hf("deepseek-v4", seed=5)
    out = save(target, tmp_path_factory.mktemp("v4-mtp"), hf_tokenizer)
    add_v4_mtp(target, out)
    _check_lossless(out)


def _check_lossless(folder: Path) -> None:
    plain = _engine(folder)
    spec = _engine(folder, speculative="mtp", num_draft_tokens=3, spec_adaptive=False)
    prompts = _prompts()
    greedy = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    for a, b in zip(plain.generate(prompts, greedy), spec.generate(prompts, greedy), strict=True):
        assert a.token_ids == b.token_ids
    seeded = [SamplingParams(max_tokens=14, temperature=0.9, seed=100 + i, ignore_eos=True) for i in range(2)]
    for p, sp in zip(prompts, seeded, strict=True):
        assert plain.generate([p], sp)[0].token_ids == spec.generate([p], sp)[0].token_ids
    counts = spec.stats.spec["mtp"]
    assert counts.drafts > 0 and counts.draft_tokens >= counts.drafts
    spec.assert_consistent()


def test_mtp_refused_without_a_module(tmp_path: Path, hf_tokenizer: Any) -> None:
    plain = save(build_hf("deepseek-v3", seed=2), tmp_path / "v3", hf_tokenizer)
    with pytest.raises(ValueError, match="multi-token-prediction module"):
        _engine(plain, speculative="mtp")


def test_mtp_first_draft_follows_the_target_hidden_states(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The proposer feeds the module the right hidden state, token and position: each first
    draft equals the module's prediction from a whole-sequence pass of the target."""
    from tripod.layers.backends import REFERENCE
    from tripod.layers.batch import ForwardBatch, PrefillSegment
    from tripod.models.deepseek import MTPModule

    seen: list[tuple[list[int], int]] = []
    real = MTPProposer.propose

    def record(self: MTPProposer, reqs: Any, lengths: Any, items: Any) -> Any:
        out = real(self, reqs, lengths, items)
        for r, p in zip(reqs, out, strict=True):
            if p is not None:
                seen.append((list(r.all_ids), p.tokens[0]))
        return out

    monkeypatch.setattr(MTPProposer, "propose", record)
    eng = _engine(folder, speculative="mtp", num_draft_tokens=2, spec_adaptive=False)
    prompt = _prompts()[1]
    (out,) = eng.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    assert seen, "MTP never proposed"
    full = prompt + out.token_ids
    net = eng.loaded.model
    n = len(full)
    # The target's hidden states at every position, in one prefill pass of its own.
    ref = _engine(folder)
    model = ref.loaded.model
    model.capture_hidden = True
    model.prepare(REFERENCE)
    batch = ForwardBatch(
        input_ids=torch.tensor(full), positions=torch.arange(n), out_slots=torch.arange(n), num_decode=0,
        decode_kv_idx=None, decode_mask=None, backend=REFERENCE, prefills=[PrefillSegment(0, n, 0, None, None)],
        logits_idx=torch.tensor([n - 1]),
    )
    model(batch, ref.pool)
    hidden = model.last_hidden
    assert hidden is not None
    pool = MTPModule.pool_spec(eng.model_config).make(n + 1, torch.float32, torch.device("cpu"))
    mtp_batch = ForwardBatch(
        input_ids=torch.tensor(full[1:]), positions=torch.arange(n - 1), out_slots=torch.arange(n - 1), num_decode=0,
        decode_kv_idx=None, decode_mask=None, backend=REFERENCE, prefills=[PrefillSegment(0, n - 1, 0, None, None)],
        logits_idx=None,
    )
    logits, _ = net.mtp(net, mtp_batch, hidden[: n - 1], pool)
    for ids, first in seen:
        length = len(ids)
        assert ids == full[:length]
        row = logits[length - 2]  # position L - 2 reads t[L-1] and predicts t[L]
        top2 = row.topk(2)
        if top2.values[0] - top2.values[1] > 1e-3:
            assert first == int(top2.indices[0]), (length, first, top2)
