"""An AWQ / GPTQ / compressed-tensors folder's int4 linears on the Triton W4A16 kernel
(``--kernels triton --weights stored``), in Triton's interpreter: greedy tokens equal to HF
transformers on the dequantized weights (float32), batched = alone, and a GGUF refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import HFReference, check_greedy_tokens
from tests.support.int_quant import save_quantized
from tests.support.tiny_models import VOCAB, build_hf
from tripod import Engine, SamplingParams

N_TOKENS = 4
PARAMS = SamplingParams(max_tokens=N_TOKENS, temperature=0.0, ignore_eos=True)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(12)
    a = torch.randint(3, VOCAB, (11,), generator=g).tolist()
    b = torch.randint(3, VOCAB, (3,), generator=g).tolist()
    return [a, b]


CASES = {  # name -> (family, method, options)
    "ct-w4a16-actorder": ("llama", "ct", dict(bits=4, group=32, sym=True, act_order=True)),
    "gptq-4bit-asym-g64": ("qwen3", "gptq", dict(bits=4, group=64, sym=False)),
    "awq-g32": ("llama", "awq", dict(bits=4, group=32)),
}


@pytest.mark.slow  # (moved out of the default run: CI runs it)
@pytest.mark.parametrize("case", list(CASES))
def test_int4_linears_run_on_the_w4a16_kernel(case: str, tmp_path: Path, hf_tokenizer: Any) -> None:
    from tripod.layers.backends.triton import W4A16Linear

    family, method, opts = CASES[case]
    over = dict(hidden_size=128, intermediate_size=256) if opts["group"] == 64 else {}
    model = build_hf(family, seed=5, **over)
    folder, deq = save_quantized(model, tmp_path / case, hf_tokenizer, method, **opts)
    model.load_state_dict(deq, strict=False)
    ref = HFReference(model.eval())
    eng = Engine(model=str(folder), kernels="triton", dtype="float32", weights="stored", kv_cache_tokens=256,
                 chunk_size=16, max_batch_tokens=64, max_running=4)
    gate_up, down = eng.loaded.model.layers[0].mlp.ops[eng.runner.backend.form]
    assert isinstance(gate_up, W4A16Linear) and isinstance(down, W4A16Linear)
    assert (gate_up.packed.perm is not None) == bool(opts.get("act_order"))
    prompts = _prompts()
    alone = [eng.generate([p], PARAMS)[0].token_ids for p in prompts]
    for i, got in enumerate(alone):
        check_greedy_tokens(got, ref.greedy(prompts[i], N_TOKENS), f"{case} prompt {i}")
    for i, out in enumerate(eng.generate(prompts, PARAMS)):
        assert list(out.token_ids) == list(alone[i]), f"{case} prompt {i}: batched differs from alone"


def test_a_gguf_with_stored_weights_is_refused_on_the_triton_backend(gguf_path: Any) -> None:
    with pytest.raises(ValueError, match="GGUF's stored weights run on tripod's CPU kernels only"):
        Engine(model=str(gguf_path), kernels="triton", dtype="float32", weights="stored", kv_cache_tokens=64)
