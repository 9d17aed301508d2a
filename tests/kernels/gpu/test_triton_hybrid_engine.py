"""Hybrid models through the whole engine on the Triton backend, in Triton's interpreter: a tiny
random Qwen3.5 (gated delta rule + gated attention), Nemotron-H / Granite 4.0 (Mamba2 + attention)
and LFM2 (short convolutions, still torch's code) give transformers' greedy tokens (fp32) alone, batched and in short prefill chunks,
their conv and recurrences on the kernels of ``tripod/kernels/gpu/recurrent.py`` over the state
pool's slots; the logprobs agree with the CPU path's to float32 rounding."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.conftest import HFReference, check_greedy_tokens
from tests.models import test_mamba_hybrids as mamba
from tests.models.test_hybrid_gdn import PROMPTS, build_qwen3_5
from tripod import Engine, SamplingParams

NEW = 8
PARAMS = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, logprobs=0)
LOGPROB_TOL = 1e-4  # the kernels' float32 sums vs torch's (GPU vs CPU order in general)


def _engine(folder: Path, kernels: str = "triton", **kw: Any) -> Engine:
    args: dict[str, Any] = dict(dtype="float32", kv_cache_tokens=512, chunk_size=64, max_batch_tokens=128,
                                max_running=4)
    return Engine(model=str(folder), kernels=kernels, **{**args, **kw})


def _all_free(eng: Engine) -> None:
    assert eng.states is not None and eng.states.num_free == eng.states.num_slots
    eng.assert_consistent()


def _check(got: list[int], ref: Any, what: str) -> None:
    if isinstance(ref, list):  # transformers' generate() tokens
        assert got == ref, what
    else:
        check_greedy_tokens(got, ref, what)


def _run_everywhere(folder: Path, prompts: list[list[int]], refs: list[Any], what: str) -> None:
    eng = _engine(folder, chunk_size=8, max_batch_tokens=32)  # (snapshots at chunk ends: the repeats hit)
    card = eng.runner.card()
    assert card["backend"] == "triton" and card["interpret"] is True, card
    assert eng.runner.graphs is None  # (a hybrid's decode rows carry state slots: eager)
    alone = [eng.generate([p], PARAMS)[0] for p in prompts]
    batched = eng.generate(prompts, PARAMS)  # (the prompts again: prefix hits resume from state snapshots)
    assert eng.stats.cached_prompt_tokens > 0
    _all_free(eng)
    chunked = _engine(folder, chunk_size=5, max_batch_tokens=12).generate(prompts, PARAMS)
    cpu = _engine(folder, kernels="eager").generate(prompts, PARAMS)
    for i in range(len(prompts)):
        for how, out in (("alone", alone[i]), ("batched", batched[i]), ("chunked", chunked[i])):
            _check(out.token_ids, refs[i], f"{what}/triton prompt {i} {how}")
        assert cpu[i].token_ids == alone[i].token_ids
        err = max(abs(a.logprob - b.logprob) for a, b in zip(alone[i].logprobs, cpu[i].logprobs, strict=True))
        assert err <= LOGPROB_TOL, f"{what} prompt {i}: logprobs {err:.3g} from the CPU path's"


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, HFReference]:
    model = build_qwen3_5()
    folder = tmp_path_factory.mktemp("qwen3_5_triton")
    model.save_pretrained(str(folder))
    return folder, HFReference(model)


@pytest.mark.slow  # (moved out of the default run: CI runs it)
def test_qwen3_5_batched_in_short_chunks(qwen3_5: tuple[Path, HFReference]) -> None:
    """The short form (the interpreter is slow): every prompt at once in chunks of 7, so steps mix
    prefill chunks that start mid-sequence with other sequences' decode rows."""
    folder, ref = qwen3_5
    short = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    eng = _engine(folder, chunk_size=7, max_batch_tokens=24)
    assert eng.runner.card()["backend"] == "triton" and eng.runner.graphs is None
    for i, out in enumerate(eng.generate(PROMPTS, short)):
        check_greedy_tokens(out.token_ids, ref.greedy(PROMPTS[i], 3), f"qwen3_5/triton prompt {i}")
    _all_free(eng)


@pytest.mark.slow  # about 3-6 min on 2 cores
def test_qwen3_5_on_the_triton_kernels(qwen3_5: tuple[Path, HFReference]) -> None:
    folder, ref = qwen3_5
    _run_everywhere(folder, PROMPTS, [ref.greedy(p, NEW) for p in PROMPTS], "qwen3_5")


@pytest.mark.slow  # about 1-1.5 min each on 2 cores
@pytest.mark.parametrize("name", ["nemotron_h_hd32", "granite_nope", "lfm2_hd32"])
def test_mamba2_hybrids_on_the_triton_kernels(name: str, tmp_path: Path, hf_tokenizer: Any) -> None:
    refs = [r[:NEW] for r in mamba._build(name, tmp_path, hf_tokenizer)]
    _run_everywhere(tmp_path, mamba.PROMPTS, refs, name)
