"""Loading a local Hugging Face folder (safetensors + config + tokenizer), and bf16.

The folder is written from the reference model (the GGUF as dequantized by transformers), so it
holds the same numbers as the embedded GGUF: an engine on it must decode the same greedy tokens
as the GGUF engine.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from tripod import Engine, SamplingParams


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory: pytest.TempPathFactory, hf_model: Any, hf_tokenizer: Any) -> Path:
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("smollm2-hf")
    # A model loaded from a GGUF carries a GGUF "quantizer" that refuses save_pretrained; rebuild
    # the same architecture without it, give it the dequantized tensors, and save that.
    cfg = type(hf_model.config).from_dict(hf_model.config.to_dict())
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    plain.load_state_dict(hf_model.state_dict(), strict=True, assign=True)
    plain.tie_weights()
    plain.save_pretrained(str(folder))
    hf_tokenizer.save_pretrained(str(folder))
    assert list(folder.glob("*.safetensors")), sorted(p.name for p in folder.iterdir())
    return folder


@pytest.fixture(scope="module")
def folder_engine(hf_folder: Path) -> Any:
    return Engine(model=str(hf_folder), dtype="float32", kv_cache_tokens=4096)


def test_hf_folder_loads_the_same_model(folder_engine: Any, base_engine: Any) -> None:
    fe, ge = folder_engine, base_engine
    assert fe.dtype_name == "float32"
    assert fe.model_name == Path(fe.loaded.path).name
    a, b = fe.model_config, ge.model_config
    for f in dataclasses.fields(a):
        if f.name in ("bos_token_id", "eos_token_ids"):
            continue
        assert getattr(a, f.name) == getattr(b, f.name), (f.name, getattr(a, f.name), getattr(b, f.name))
    assert set(a.eos_token_ids) & set(b.eos_token_ids)
    assert fe.eos_ids == ge.eos_ids
    # The same numbers: tripod's GGUF dequantization and transformers' agree bit for bit.
    fw = dict(fe.loaded.model.named_parameters())
    gw = dict(ge.loaded.model.named_parameters())
    assert fw.keys() == gw.keys()
    for name, w in fw.items():
        assert w.dtype == torch.float32
        assert torch.equal(w, gw[name]), f"weight {name} differs between the HF folder and the GGUF"


def test_hf_folder_greedy_tokens_equal_gguf(folder_engine: Any, engine: Any) -> None:
    texts = [
        "The capital of France is",
        "Les élèves étudient à l'école parce que",
        "def fibonacci(n):\n",
    ]
    msgs = [{"role": "user", "content": "Write a haiku about the sea."}]
    assert folder_engine.apply_chat_template(msgs) == engine.apply_chat_template(msgs)
    prompts: list[Any] = [*texts, engine.apply_chat_template(msgs)]
    for t in texts:
        assert folder_engine.encode(t) == engine.encode(t)
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    got = folder_engine.generate(prompts, params)
    want = engine.generate(prompts, params)
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        assert g.text == w.text
    folder_engine.assert_consistent()


def test_bfloat16_smoke(base_engine: Any) -> None:
    eng = Engine(dtype="bfloat16", kv_cache_tokens=1024)
    assert eng.dtype_name == "bfloat16" and eng.dtype == torch.bfloat16
    assert eng.loaded.model.embed.dtype == torch.bfloat16
    kv_tensors = [
        v for n in dir(eng.pool) if not n.startswith("__")
        for v in [getattr(eng.pool, n, None)] if isinstance(v, torch.Tensor)
    ]
    assert kv_tensors and all(t.dtype == torch.bfloat16 for t in kv_tensors), "KV cache not in bf16"
    (o,) = eng.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0.0))
    assert "Paris" in o.text, o.text
    chat = eng.apply_chat_template([{"role": "user", "content": "What is 2 + 2?"}])
    (o,) = eng.generate([chat], SamplingParams(max_tokens=16, temperature=0.0))
    assert o.text.strip() and "4" in o.text, o.text
    eng.assert_consistent()
