"""Vision-language models on the Triton backend (the CUDA backend's code path), in Triton's
interpreter on CPU tensors: Qwen2.5-VL's M-RoPE rows go through the Triton RoPE + KV write kernel
(indexed by row), LLaVA's image features through the paged attention kernel; greedy tokens equal
transformers' (float32). Gemma 3 runs torch's attention there (its bidirectional image masks)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import check_greedy_tokens
from tests.support import tiny_vlms
from tripod import Engine, SamplingParams


@pytest.mark.parametrize(("kind", "attention"), [("qwen2_5_vl", "triton"), ("gemma3", "torch")])
def test_vision_models_on_the_triton_backend(tiny_vlm: Any, kind: str, attention: str) -> None:
    vlm = tiny_vlm(kind)
    eng = Engine(model=str(vlm.folder), kernels="triton", kv_cache_tokens=256, chunk_size=16, max_batch_tokens=64,
                 max_running=8)
    card = eng.runner.card()
    assert card["backend"] == "triton" and ("attention" in card) == (attention == "torch"), card
    msgs = tiny_vlms.messages("What is this?", 1)
    img = tiny_vlms.image(5, (64, 48))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1)
    (out,) = eng.generate([eng.image_prompt(msgs, [img])], params)
    ref = tiny_vlms.hf_greedy(vlm, vlm.template(msgs), [img], 6)
    same = check_greedy_tokens(out.token_ids, ref, f"{kind}/triton")
    worst = max(abs(lp.logprob - r) for lp, r in zip(out.logprobs[:same], ref.logprobs, strict=False))
    assert worst < 1e-3, f"{kind}/triton: a logprob differs from transformers' by {worst:.3g}"
    eng.assert_consistent()
