"""Nemotron-H and Granite 4.0 hybrids (Mamba2 + attention + MLP/MoE) and LFM2 (short convolutions
+ attention) through the engine, token-exact against Hugging Face transformers in float32.

Tiny checkpoints are built from transformers' own configs with every weight random and saved with
``save_pretrained``; tripod loads the folder (attention on the paged KV pool, the Mamba2 / short-conv
states in the ``StatePool``) and its greedy tokens are compared with transformers' ``generate`` on the
same weights: each prompt alone, all in one batch, and with prefill chunks shorter than the prompts.
After every run the state pool's slots are all free again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tripod import Engine, SamplingParams
from tripod.models.config import ModelConfig
from tripod.models.hybrid import StateSpaceHybrid
from tripod.models.lfm2 import Lfm2ForCausalLM
from tripod.models.nemotron_h import NemotronHForCausalLM, layer_kinds, nemotron_mamba

transformers = pytest.importorskip("transformers")

VOCAB, NEW = 128, 12
PARAMS = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, logprobs=0)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    # 21 > HF's SSD chunk of 8: its prefill crosses chunk boundaries
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (21, 4, 13)]


PROMPTS = _prompts()


def _nemotron_config(**over: Any) -> Any:
    kw: dict[str, Any] = dict(
        vocab_size=VOCAB, hidden_size=32,
        layers_block_type=["linear_attention", "moe", "full_attention", "mlp", "linear_attention", "moe"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, mamba_num_heads=4, mamba_head_dim=16,
        ssm_state_size=8, n_groups=2, conv_kernel=4, chunk_size=8, intermediate_size=48, n_routed_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=16, moe_shared_expert_intermediate_size=24, n_group=2,
        topk_group=1, routed_scaling_factor=1.5, max_position_embeddings=256,
    )
    return transformers.NemotronHConfig(**{**kw, **over})


def _granite_config(rope: bool, experts: int) -> Any:
    return transformers.GraniteMoeHybridConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, layer_types=["mamba", "attention", "mamba", "mamba"],
        num_attention_heads=4, num_key_value_heads=2, intermediate_size=16, shared_intermediate_size=24,
        num_local_experts=experts, num_experts_per_tok=2, mamba_n_heads=4, mamba_n_groups=2, mamba_d_state=8,
        mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8, embedding_multiplier=12.0, logits_scaling=4.0,
        residual_multiplier=0.3, attention_multiplier=0.1, position_embedding_type="rope" if rope else None,
        max_position_embeddings=256,
    )


def _lfm2_config(**over: Any) -> Any:
    kw: dict[str, Any] = dict(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, layer_types=["conv", "full_attention", "conv", "conv"],
        num_attention_heads=4, num_key_value_heads=2, intermediate_size=96, block_multiple_of=16, conv_L_cache=3,
        max_position_embeddings=256,
    )
    return transformers.Lfm2Config(**{**kw, **over})


CASES = {
    "nemotron_h": (lambda: _nemotron_config(), "NemotronHForCausalLM"),
    "nemotron_h_latent_moe": (
        lambda: _nemotron_config(layers_block_type=["linear_attention", "moe", "full_attention"], moe_latent_size=16),
        "NemotronHForCausalLM"),
    "granite_rope_moe": (lambda: _granite_config(True, 4), "GraniteMoeHybridForCausalLM"),
    "granite_nope": (lambda: _granite_config(False, 0), "GraniteMoeHybridForCausalLM"),
    "lfm2": (_lfm2_config, "Lfm2ForCausalLM"),
    # head_dim 32: a shape the CPU kernels' paged attention covers
    "nemotron_h_hd32": (lambda: _nemotron_config(layers_block_type=["linear_attention", "full_attention", "mlp",
                                                                     "linear_attention"], head_dim=32),
                        "NemotronHForCausalLM"),
    "lfm2_hd32": (lambda: _lfm2_config(hidden_size=64, num_attention_heads=2, num_key_value_heads=1), "Lfm2ForCausalLM"),
}
KERNEL_CASES = {"nemotron_h_hd32", "lfm2_hd32"}


def _build(name: str, folder: Path, tokenizer: Any) -> list[list[int]]:
    """Save the case's random HF model (and a tokenizer) in ``folder``; return its greedy tokens (``generate``) per prompt."""
    make, arch = CASES[name]
    cfg = make()
    torch.manual_seed(0)
    hf = getattr(transformers, arch)(cfg).eval()
    # every weight random (transformers' init leaves some at zero or one, which would hide a wrong
    # name or a missing term): norms around 1, the rest around 0
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.1 * noise if "norm" in n else 0.2 * noise)
    hf.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    hf.generation_config.eos_token_id = None  # greedy for NEW tokens, whatever they are
    refs = []
    with torch.no_grad():
        for p in PROMPTS:
            ids = torch.tensor([p])
            out = hf.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
            refs.append(out[0, len(p):].tolist())
    return refs


def _engine(folder: Path, **kw: Any) -> Engine:
    args: dict[str, Any] = dict(dtype="float32", kv_cache_tokens=512, chunk_size=64, max_batch_tokens=128,
                                max_running=4, kernels="eager")
    return Engine(model=str(folder), **{**args, **kw})


def _all_free(eng: Engine) -> None:
    states = eng.states
    assert states is not None
    assert states.num_free == states.num_slots, "a finished request kept its state slot"
    eng.assert_consistent()


SLOW = {"nemotron_h_latent_moe", "granite_rope_moe"}  # (HF's MoE loops make their references slow)


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in CASES if n not in KERNEL_CASES])
def test_greedy_parity_alone_batched_chunked(name: str, tmp_path: Path, hf_tokenizer: Any) -> None:
    refs = _build(name, tmp_path, hf_tokenizer)
    eng = _engine(tmp_path)
    assert eng.model_config.architecture == CASES[name][1]
    model = eng.runner.model
    assert isinstance(model, StateSpaceHybrid)
    assert eng.states is not None and eng.states.spec == model.state_spec() and eng.states.num_slots == 4
    for i, p in enumerate(PROMPTS):
        (out,) = eng.generate([p], PARAMS)
        assert out.token_ids == refs[i], f"{name} prompt {i} alone"
    _all_free(eng)
    for i, out in enumerate(eng.generate(PROMPTS, PARAMS)):
        assert out.token_ids == refs[i], f"{name} prompt {i} batched"
    _all_free(eng)
    chunked = _engine(tmp_path, chunk_size=5, max_batch_tokens=12)
    for i, out in enumerate(chunked.generate(PROMPTS, PARAMS)):
        assert out.token_ids == refs[i], f"{name} prompt {i} chunked"
    _all_free(chunked)


def _logprobs(out: Any) -> list[float]:
    return [lp.logprob for lp in out.logprobs]


@pytest.mark.parametrize("name", sorted(KERNEL_CASES))
def test_kernels_bit_exact_alone_batched_chunked(name: str, tmp_path: Path, hf_tokenizer: Any) -> None:
    """On tripod's CPU kernels (whose rows never depend on their batch) the logprobs of every token
    are equal bit for bit alone, batched and chunked: a sequence's state does not depend on how its
    tokens were split into steps nor on what else ran beside it."""
    refs = _build(name, tmp_path, hf_tokenizer)
    eng = _engine(tmp_path, kernels="optimized")
    alone = [eng.generate([p], PARAMS)[0] for p in PROMPTS]
    if not eng.runner.uses_kernels:
        pytest.skip(f"tripod's CPU kernels do not run here: {eng.runner.kernel_reason or eng.runner.attention_reason}")
    batched = eng.generate(PROMPTS, PARAMS)
    chunked = _engine(tmp_path, kernels="optimized", chunk_size=5, max_batch_tokens=12).generate(PROMPTS, PARAMS)
    for i in range(len(PROMPTS)):
        assert alone[i].token_ids == refs[i], f"{name} prompt {i} alone (kernels)"
        for what, out in (("batched", batched[i]), ("chunked", chunked[i])):
            assert out.token_ids == alone[i].token_ids, f"{name} prompt {i} {what}"
            assert _logprobs(out) == _logprobs(alone[i]), f"{name} prompt {i}: {what} logprobs differ from alone"
    _all_free(eng)


def test_refuses_what_its_state_cannot_follow(tmp_path: Path, hf_tokenizer: Any) -> None:
    """As every hybrid with a state pool: self-drafting refused at start; a prompt with no state
    snapshot exports nothing (nothing could resume it: tests/models/test_hybrid_disk.py)."""
    _build("lfm2", tmp_path, hf_tokenizer)
    with pytest.raises(ValueError, match="--speculative self:K"):
        _engine(tmp_path, speculative="self:1")
    eng = _engine(tmp_path)
    assert eng.export_kv(PROMPTS[0]) == []
    _all_free(eng)


def test_state_spec_and_kv_layers() -> None:
    """Only the attention layers hold K/V; each Mamba2 layer's (conv, ssm) and each short-conv
    layer's window is one entry of the state pool's layout, in layer order."""
    d = _nemotron_config().to_dict()
    cfg = ModelConfig.from_hf_dict(d)
    assert cfg.pool_spec().num_layers == 1  # one full_attention layer of six
    model = NemotronHForCausalLM(cfg, torch.float32, torch.device("cpu"))
    m = nemotron_mamba(d)
    assert model.state_spec().layers == (m.state_shapes(), m.state_shapes())
    assert [layer.pool_layer for layer in model.layers if layer.kind == "full_attention"] == [0]
    lfm = ModelConfig.from_hf_dict(_lfm2_config().to_dict())
    assert lfm.pool_spec().num_layers == 1 and lfm.qk_norm
    assert Lfm2ForCausalLM(lfm, torch.float32, torch.device("cpu")).state_spec().layers == (((32, 2),),) * 3


def test_layer_kinds_and_refusals() -> None:
    assert layer_kinds({"hybrid_override_pattern": "M*-E"}) == ["linear_attention", "full_attention", "mlp", "moe"]
    with pytest.raises(ValueError, match="unknown layer codes"):
        layer_kinds({"hybrid_override_pattern": "MX"})
    with pytest.raises(ValueError, match="layers_block_type or hybrid_override_pattern"):
        layer_kinds({})
    nd = _nemotron_config().to_dict()
    legacy = {k: v for k, v in nd.items() if k not in ("n_groups", "conv_kernel")} | {"mamba_n_groups": 2, "mamba_d_conv": 4}
    assert nemotron_mamba(legacy) == nemotron_mamba(nd)
    with pytest.raises(ValueError, match="ssm_state_size"):
        nemotron_mamba({k: v for k, v in nd.items() if k != "ssm_state_size"})
    d = _granite_config(False, 0).to_dict()
    with pytest.raises(ValueError, match="num_hidden_layers"):
        ModelConfig.from_hf_dict({**d, "num_hidden_layers": 5})
    with pytest.raises(ValueError, match="position_embedding_type"):
        ModelConfig.from_hf_dict({**d, "position_embedding_type": "alibi"})


def test_stored_weights_refused_on_a_folder_but_not_a_gguf() -> None:
    """--weights stored runs these families' GGUF blocks (tests/loader/test_gguf_hybrid.py); on a
    checkpoint folder of them (an integer-quantized one is not read as stored yet) it is refused at
    start with the reason, and --lora is refused either way."""
    from tripod.config import EngineConfig
    from tripod.engine.builder import check_hybrid

    mc = ModelConfig.from_hf_dict(_lfm2_config().to_dict())
    check_hybrid(EngineConfig(model="tiny.Q8_0.gguf", weights="stored"), mc)  # (accepted)
    with pytest.raises(ValueError, match="Lfm2ForCausalLM runs a GGUF file's quantized blocks"):
        check_hybrid(EngineConfig(model="awq-folder", weights="stored"), mc)
    with pytest.raises(ValueError, match="--lora is not supported on hybrid"):
        check_hybrid(EngineConfig(model="tiny.Q8_0.gguf", weights="stored", lora="a=/nonexistent"), mc)


@pytest.mark.parametrize("name", sorted(KERNEL_CASES))
def test_prefix_hits_resume_from_state_snapshots(name: str, tmp_path: Path, hf_tokenizer: Any) -> None:
    """The state snapshots on radix nodes serve the Mamba2 / short-conv families as they serve the
    Gated DeltaNet one: a repeated prompt resumes at its last chunk end, the next turn (prompt +
    answer + more) at the end of the answer's computed tokens, each skipping exactly
    ``cached_tokens`` — with the tokens and (on the kernels) the logprobs of an engine that never saw
    them."""
    _build(name, tmp_path, hf_tokenizer)
    eng = _engine(tmp_path, kernels="optimized", chunk_size=8, max_batch_tokens=32)
    fresh = _engine(tmp_path, kernels="optimized", chunk_size=8, max_batch_tokens=32, enable_prefix_cache=False)
    assert eng.scheduler.snapshots is not None
    p = PROMPTS[0]  # 21 tokens: chunks end at 8 and 16
    (first,) = eng.generate([p], PARAMS)
    assert first.cached_tokens == 0
    (again,) = eng.generate([p], PARAMS)
    assert again.cached_tokens == 16
    longer = p + first.token_ids + PROMPTS[1]
    (ext,) = eng.generate([longer], PARAMS)
    assert ext.cached_tokens == len(p) + NEW - 1  # all but the answer's last token (never computed)
    for got, prompt in ((again, p), (ext, longer)):
        (want,) = fresh.generate([prompt], PARAMS)
        assert got.token_ids == want.token_ids, f"{name}: a hit changed the tokens"
        if eng.runner.uses_kernels:
            assert _logprobs(got) == _logprobs(want), f"{name}: a hit changed the logprobs"
    _all_free(eng)
