"""Nemotron-H and Granite 4.0 hybrids (Mamba2 + attention + MLP/MoE) and LFM2 (short convolutions
+ attention) against Hugging Face transformers in float32, on tiny checkpoints built from
transformers' own configs with every weight random: prefill logits, greedy tokens against
``generate``, and a chunked prefill against a whole one."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tripod.layers.backends.reference import ReferenceBackend
from tripod.models.granite_hybrid import GraniteMoeHybridForCausalLM
from tripod.models.hybrid import HybridCache, HybridForCausalLM
from tripod.models.lfm2 import Lfm2ForCausalLM
from tripod.models.nemotron_h import NemotronHForCausalLM, layer_kinds, nemotron_mamba

transformers = pytest.importorskip("transformers")

PROMPT_LEN, NEW = 13, 16  # 13 > HF's SSD chunk of 8: its prefill crosses a chunk boundary


def _nemotron_config(**over: Any) -> Any:
    kw: dict[str, Any] = dict(
        vocab_size=128, hidden_size=32,
        layers_block_type=["linear_attention", "moe", "full_attention", "mlp", "linear_attention", "moe"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, mamba_num_heads=4, mamba_head_dim=16,
        ssm_state_size=8, n_groups=2, conv_kernel=4, chunk_size=8, intermediate_size=48, n_routed_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=16, moe_shared_expert_intermediate_size=24, n_group=2,
        topk_group=1, routed_scaling_factor=1.5,
    )
    return transformers.NemotronHConfig(**{**kw, **over})


def _granite_config(rope: bool, experts: int) -> Any:
    return transformers.GraniteMoeHybridConfig(
        vocab_size=128, hidden_size=32, num_hidden_layers=4, layer_types=["mamba", "attention", "mamba", "mamba"],
        num_attention_heads=4, num_key_value_heads=2, intermediate_size=16, shared_intermediate_size=24,
        num_local_experts=experts, num_experts_per_tok=2, mamba_n_heads=4, mamba_n_groups=2, mamba_d_state=8,
        mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8, embedding_multiplier=12.0, logits_scaling=4.0,
        residual_multiplier=0.3, attention_multiplier=0.1, position_embedding_type="rope" if rope else None,
        max_position_embeddings=256,
    )


def _pair(hf_cls: Any, ours_cls: type[HybridForCausalLM], cfg: Any) -> tuple[Any, HybridForCausalLM]:
    torch.manual_seed(0)
    hf = hf_cls(cfg).eval()
    # every weight random (transformers' init leaves some at zero or one, which would hide a wrong
    # name or a missing term): norms around 1, the rest around 0
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.2 * noise)
    hf.generation_config.eos_token_id = None  # greedy for NEW tokens, whatever they are
    ours = ours_cls(cfg.to_dict())
    ours.load_weights(hf.state_dict())
    ours.prepare(ReferenceBackend())
    return hf, ours


@pytest.fixture(scope="module")
def nemotron() -> tuple[Any, HybridForCausalLM]:
    return _pair(transformers.NemotronHForCausalLM, NemotronHForCausalLM, _nemotron_config())


def _prompt(seed: int) -> torch.Tensor:
    return torch.randint(0, 128, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(seed))


def _check_against_hf(hf: Any, ours: HybridForCausalLM, seed: int) -> None:
    ids = _prompt(seed)
    with torch.no_grad():
        ref_logits = hf(ids).logits[0]
        ref = hf.generate(ids, max_new_tokens=NEW, do_sample=False)[0, PROMPT_LEN:].tolist()
    torch.testing.assert_close(ours(ids[0], HybridCache()), ref_logits, rtol=1e-5, atol=1e-5)
    assert ours.greedy(ids[0].tolist(), NEW) == ref


def test_nemotron_h_matches_transformers(nemotron: tuple[Any, HybridForCausalLM]) -> None:
    """Mamba2, MoE (grouped sigmoid routing, shared expert), attention and ReLU² MLP layers."""
    _check_against_hf(*nemotron, seed=1)


def test_nemotron_h_latent_moe_matches_transformers() -> None:
    hf, ours = _pair(transformers.NemotronHForCausalLM, NemotronHForCausalLM,
                     _nemotron_config(layers_block_type=["linear_attention", "moe", "full_attention"], moe_latent_size=16))
    _check_against_hf(hf, ours, seed=2)


@pytest.mark.parametrize(("rope", "experts"), [(True, 4), (False, 0)])
def test_granite_hybrid_matches_transformers(rope: bool, experts: int) -> None:
    """With RoPE and a MoE beside the shared MLP; without either (Granite 4.0-H's own shape)."""
    hf, ours = _pair(transformers.GraniteMoeHybridForCausalLM, GraniteMoeHybridForCausalLM, _granite_config(rope, experts))
    _check_against_hf(hf, ours, seed=3)


def test_lfm2_matches_transformers() -> None:
    """Short-conv and attention (q/k norms, RoPE) layers, SwiGLU MLPs, tied embeddings."""
    cfg = transformers.Lfm2Config(
        vocab_size=128, hidden_size=32, num_hidden_layers=4, layer_types=["conv", "full_attention", "conv", "conv"],
        num_attention_heads=4, num_key_value_heads=2, intermediate_size=96, block_multiple_of=16, conv_L_cache=3,
        max_position_embeddings=256,
    )
    hf, ours = _pair(transformers.Lfm2ForCausalLM, Lfm2ForCausalLM, cfg)
    _check_against_hf(hf, ours, seed=5)
    assert ours.greedy(_prompt(5)[0].tolist(), 8, chunk=4) == ours.greedy(_prompt(5)[0].tolist(), 8)


@pytest.mark.parametrize("chunk", [1, 5])
def test_chunked_prefill_matches_whole(nemotron: tuple[Any, HybridForCausalLM], chunk: int) -> None:
    """A prompt fed in chunks (state and K/V carried) gives the whole prefill's tokens and states
    (to float32 rounding here: torch's matmuls round a row differently with the row count; the
    mixer itself is bit-exact, ``tests/layers/test_mamba2.py``)."""
    _, ours = nemotron
    prompt = _prompt(4)[0]
    whole, chunked = HybridCache(), HybridCache()
    ours(prompt, whole)
    for i in range(0, PROMPT_LEN, chunk):
        ours(prompt[i : i + chunk], chunked)
    assert chunked.length == whole.length == PROMPT_LEN
    for layer, (conv, ssm) in whole.states.items():
        torch.testing.assert_close(chunked.states[layer][1], ssm, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(chunked.states[layer][0], conv, rtol=1e-5, atol=1e-6)
    assert ours.greedy(prompt.tolist(), 8, chunk=chunk) == ours.greedy(prompt.tolist(), 8)


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
        GraniteMoeHybridForCausalLM({**d, "num_hidden_layers": 5})
    with pytest.raises(ValueError, match="position_embedding_type"):
        GraniteMoeHybridForCausalLM({**d, "position_embedding_type": "alibi"})
