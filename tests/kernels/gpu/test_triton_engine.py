"""The whole engine on the Triton backend (the CUDA backend's code path), run in Triton's
interpreter on CPU tensors: tiny random Llama, Qwen3, Gemma 3 (sliding windows, per-layer RoPE),
gpt-oss (attention sinks) and DeepSeek-V3 (MLA: the absorbed-decode kernel) checkpoints give the
reference path's greedy tokens (which are Hugging Face's, fp32) alone, batched with prefix-cache
hits, with chunked prefill, and with speculative verify rows; and the engine reports what runs."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import check_greedy_tokens
from tests.models import test_architectures as arch
from tests.models.test_architectures import PROMPTS, _check_engine
from tripod import Engine, SamplingParams
from tripod.protocol.sampling import GrammarSpec

slow = pytest.mark.slow
tiny = arch.tiny  # the architectures suite's tiny checkpoints (a module-scoped fixture)


def _engine(folder: Path, kv: int = 256, **kw: Any) -> Engine:
    return Engine(model=str(folder), kernels="triton", kv_cache_tokens=kv, chunk_size=16, max_batch_tokens=64,
                  max_running=8, **kw)


def _check_card(eng: Engine, kind: str) -> None:
    card = eng.runner.card()
    assert card["backend"] == "triton" and card["interpret"] is True, card
    assert ("attention" in card) == (kind == "deepseek-v3"), card  # MLA: torch's layout, the Triton decode kernel


@pytest.mark.parametrize("kind", ["llama", "deepseek-v3"])
def test_greedy_tokens_alone_then_batched_from_the_cache(kind: str, tiny: Any) -> None:
    """The short form (the interpreter is slow): a 38-token prompt in chunks of 16, alone, then
    beside a 7-token one with its prefix cached."""
    folder, ref = tiny(kind)
    eng = _engine(folder)
    _check_card(eng, kind)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    long, short = PROMPTS[3], PROMPTS[1]
    (alone,) = eng.generate([long], params)
    check_greedy_tokens(alone.token_ids, ref.greedy(long, 8), f"{kind}/triton alone, chunked")
    both = eng.generate([long, short], params)
    assert eng.stats.cached_prompt_tokens > 0
    check_greedy_tokens(both[0].token_ids, ref.greedy(long, 8), f"{kind}/triton batched, cached")
    check_greedy_tokens(both[1].token_ids, ref.greedy(short, 8), f"{kind}/triton batched")
    eng.assert_consistent()


@slow
@pytest.mark.parametrize("kind", ["llama", "deepseek-v3", "qwen3", "gemma3", "gpt-oss"])
def test_greedy_tokens_alone_batched_cached_and_chunked(kind: str, tiny: Any) -> None:
    """The architectures suite's full check (four prompts, alone and batched), with a pool wide
    enough for two KV splits per token."""
    folder, ref = tiny(kind)
    eng = _engine(folder, kv=1024)
    _check_card(eng, kind)
    _check_engine(eng, ref, f"{kind}/triton")


@pytest.mark.slow  # (moved out of the default run: CI runs it)
def test_speculative_verify_rows_on_the_kernels(tiny: Any) -> None:
    """n-gram speculation's verify rows (several query positions of one request in one block)."""
    folder, ref = tiny("llama")
    eng = _engine(folder, speculative="ngram")
    prompt = PROMPTS[0] + PROMPTS[0][:20]  # a repeat, so the n-gram proposer drafts
    (out,) = eng.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    check_greedy_tokens(out.token_ids, ref.greedy(prompt, 24), "llama/triton with n-gram speculation")
    drafted = sum(c.draft_tokens for k, c in eng.stats.spec.items() if k != "jump_forward")
    assert drafted > 0, "nothing was verified"
    eng.assert_consistent()


def test_the_overlap_scheduler_on_the_kernels_and_graphs(tiny: Any) -> None:
    """Decode steps laid out during the previous forward (their input ids the previous draws,
    gathered on the device) and replayed through the decode graphs: the same greedy tokens."""
    folder, ref = tiny("llama")
    eng = _engine(folder, overlap_schedule="on")
    assert eng.lookahead is not None and eng.runner.graphs is not None
    prompts = [PROMPTS[1], PROMPTS[2]]
    outs = eng.generate(prompts, [SamplingParams(max_tokens=6 + 2 * i, temperature=0.0, ignore_eos=True)
                                  for i in range(2)])
    for i, (p, out) in enumerate(zip(prompts, outs, strict=True)):
        check_greedy_tokens(out.token_ids, ref.greedy(p, 6 + 2 * i), f"llama/triton, overlap, prompt {i}")
    assert eng.lookahead.counts.adopted >= 3, eng.lookahead.counts
    assert eng.runner.graphs.replays > 0
    eng.assert_consistent()


def test_grammar_masks_on_the_device_kernel(tmp_path: Path, hf_tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A regex-constrained request on the Triton backend masks with the device kernel (XGrammar's
    bitmask uploaded) and gives the tokens the reference path's host masks give. (A tiny Llama
    with the tokenizer's whole vocabulary, so the grammar's tokens exist.)"""
    from tests.support import tiny_models

    monkeypatch.setitem(tiny_models.COMMON, "vocab_size", len(hf_tokenizer))
    folder = tiny_models.save(tiny_models.build_hf("llama"), tmp_path / "llama-full-vocab", hf_tokenizer)
    grammar = GrammarSpec("regex", "(yes|no|maybe), [a-z]{2,6}\\.")
    params = SamplingParams(max_tokens=12, temperature=0.0, grammar=grammar)
    eng, ref = _engine(folder, jump_forward=False), Engine(model=str(folder), kernels="eager", kv_cache_tokens=256)
    got = eng.generate([PROMPTS[1], PROMPTS[2]], [params, SamplingParams(max_tokens=4, temperature=0.0)])
    want = ref.generate([PROMPTS[1], PROMPTS[2]], [params, SamplingParams(max_tokens=4, temperature=0.0)])
    assert eng.grammars.device_kernel and not ref.grammars.device_kernel
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert re.fullmatch("(yes|no|maybe), [a-z]{2,6}\\.", got[0].text), got[0].text


def test_bfloat16_is_refused_in_the_interpreter(tiny: Any) -> None:
    folder, _ = tiny("llama")
    with pytest.raises(ValueError, match="no bfloat16"):
        Engine(model=str(folder), kernels="triton", dtype="bfloat16", kv_cache_tokens=64)


@pytest.mark.slow  # (moved out of the default run: CI runs it)
def test_serve_on_the_triton_backend_says_so(tiny: Any, tmp_path: Path, hf_tokenizer: Any) -> None:
    """``TRITON_INTERPRET=1 tripod serve --kernels triton --device cpu``: /v1/models reports the
    compute path, and a completion through the official client gives the engine's greedy tokens."""
    import openai

    from tests.support.server_helpers import ServerProcess

    folder, ref = tiny("llama")
    server = ServerProcess(tmp_path, "--model", str(folder), "--kernels", "triton", "--device", "cpu",
                           "--kv-cache-tokens", "256")
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
        (card,) = client.models.list().model_dump()["data"]
        assert card["compute"]["backend"] == "triton" and card["compute"]["interpret"] is True, card
        prompt = PROMPTS[1]
        out = client.completions.create(model=card["id"], prompt=prompt, max_tokens=6, temperature=0.0,
                                        extra_body={"ignore_eos": True})
        assert out.choices[0].finish_reason == "length"
        want = ref.greedy(prompt, 6).tokens
        assert out.choices[0].text == hf_tokenizer.decode(want, skip_special_tokens=True)
    finally:
        server.stop()
