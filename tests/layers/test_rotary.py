"""Rotary embeddings against transformers' own implementation (the reference the models were
trained with): inverse frequencies, attention scaling, and the rotation itself."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from tripod.layers.rotary import RotaryEmbedding, apply_rotary, rope_inv_freq

HEAD_DIM = 32


def _config(rope_parameters: dict[str, Any], max_pos: int = 8192) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=4 * HEAD_DIM,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=HEAD_DIM,
        intermediate_size=64,
        num_hidden_layers=1,
        vocab_size=32,
        max_position_embeddings=max_pos,
        rope_parameters=copy.deepcopy(rope_parameters),
    )


def _hf(cfg: LlamaConfig) -> tuple[torch.Tensor, float]:
    rope = LlamaRotaryEmbedding(cfg)
    return rope.inv_freq, float(rope.attention_scaling)


def _ours(cfg: LlamaConfig, params: dict[str, Any]) -> tuple[torch.Tensor, float]:
    # tripod's model config hands rope_inv_freq the rope dict as the checkpoint spells it
    # (theta separately), so pass the dict the test wrote, not transformers' standardised copy.
    return rope_inv_freq(HEAD_DIM, float(params["rope_theta"]), params, cfg.max_position_embeddings)


CASES: dict[str, dict[str, Any]] = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "yarn": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 2048,
    },
    "yarn-betas-mscale": {
        "rope_type": "yarn",
        "rope_theta": 1000000.0,
        "factor": 8.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 16,
        "beta_slow": 2,
        "mscale": 1.0,
        "mscale_all_dim": 0.5,
    },
    "yarn-attention-factor-no-truncate": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 2.0,
        "original_max_position_embeddings": 4096,
        "attention_factor": 1.3,
        "truncate": False,
    },
    "yarn-no-original": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0},
}


@pytest.mark.parametrize("name", list(CASES))
def test_inv_freq_and_scaling_match_transformers(name: str) -> None:
    params = CASES[name]
    cfg = _config(params)
    ref_freq, ref_scale = _hf(cfg)
    freq, scale = _ours(cfg, copy.deepcopy(params))
    assert freq.dtype == torch.float32 and freq.shape == (HEAD_DIM // 2,)
    torch.testing.assert_close(freq, ref_freq.float(), rtol=1e-6, atol=0.0)
    assert math.isclose(scale, ref_scale, rel_tol=1e-6)


def test_cases_exercise_every_branch() -> None:
    """Guard against a vacuous comparison: the scaled variants really change frequencies."""
    base, _ = rope_inv_freq(HEAD_DIM, 500000.0, None, 8192)
    llama3, _ = rope_inv_freq(HEAD_DIM, 500000.0, CASES["llama3"], 8192)
    ratio = base / llama3
    kept = torch.isclose(ratio, torch.tensor(1.0))
    divided = torch.isclose(ratio, torch.tensor(8.0))
    blended = ~kept & ~divided
    assert kept.any() and divided.any() and blended.any(), ratio

    base, _ = rope_inv_freq(HEAD_DIM, 10000.0, None, 8192)
    yarn, scale = rope_inv_freq(HEAD_DIM, 10000.0, CASES["yarn"], 8192)
    ratio = base / yarn
    assert torch.isclose(ratio[0], torch.tensor(1.0)), "highest frequency is extrapolated"
    assert torch.isclose(ratio[-1], torch.tensor(4.0)), "lowest frequency is interpolated"
    assert ((ratio > 1.0001) & (ratio < 3.999)).any(), "a ramp in between"
    assert scale > 1.0


def test_unknown_rope_type_is_refused() -> None:
    with pytest.raises(ValueError, match="longrope"):
        rope_inv_freq(HEAD_DIM, 10000.0, {"rope_type": "longrope", "factor": 2.0}, 4096)


@pytest.mark.parametrize("name", ["default", "llama3", "yarn"])
def test_apply_rotary_matches_transformers(name: str) -> None:
    params = CASES[name]
    cfg = _config(params)
    hf_rope = LlamaRotaryEmbedding(cfg)
    ours = RotaryEmbedding(HEAD_DIM, float(params["rope_theta"]), params, 4096, torch.device("cpu"))

    positions = torch.tensor([0, 1, 7, 100, 2047, 4095])
    heads = 3
    g = torch.Generator().manual_seed(0)
    q = torch.randn(len(positions), heads, HEAD_DIM, generator=g)  # tripod layout [T, H, D]
    k = torch.randn(len(positions), heads, HEAD_DIM, generator=g)

    cos, sin = ours.tables(positions, torch.float32)
    got_q, got_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

    # transformers: [B, H, T, D] with cos/sin [B, T, D].
    hf_cos, hf_sin = hf_rope(q, positions.unsqueeze(0))
    ref_q, ref_k = apply_rotary_pos_emb(
        q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), hf_cos, hf_sin
    )
    torch.testing.assert_close(got_q, ref_q[0].transpose(0, 1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_k, ref_k[0].transpose(0, 1), rtol=1e-5, atol=1e-5)


def test_rotation_preserves_norm_and_position_zero_is_identity() -> None:
    rope = RotaryEmbedding(HEAD_DIM, 10000.0, None, 64, torch.device("cpu"))
    x = torch.randn(5, 2, HEAD_DIM, generator=torch.Generator().manual_seed(1))
    cos, sin = rope.tables(torch.tensor([0, 1, 2, 30, 63]), torch.float32)
    y = apply_rotary(x, cos, sin)
    torch.testing.assert_close(y[0], x[0])
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))
    assert not torch.allclose(y[3], x[3])


def test_relative_position_property() -> None:
    """<rot(q, m), rot(k, n)> depends only on m - n: what makes RoPE a relative encoding."""
    rope = RotaryEmbedding(HEAD_DIM, 10000.0, None, 128, torch.device("cpu"))
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 1, HEAD_DIM, generator=g)
    k = torch.randn(1, 1, HEAD_DIM, generator=g)

    def score(m: int, n: int) -> float:
        cm, sm = rope.tables(torch.tensor([m]), torch.float32)
        cn, sn = rope.tables(torch.tensor([n]), torch.float32)
        return float((apply_rotary(q, cm, sm) * apply_rotary(k, cn, sn)).sum())

    assert math.isclose(score(10, 3), score(57, 50), rel_tol=1e-4)
    assert not math.isclose(score(10, 3), score(10, 4), rel_tol=1e-3)


def test_gguf_rope_freq_factors_divide_each_frequency() -> None:
    from tripod.layers.rotary import rope_inv_freq

    base, _ = rope_inv_freq(8, 10000.0, None, 128)
    factors = [1.0, 2.0, 4.0, 8.0]
    scaled, attn = rope_inv_freq(8, 10000.0, {"rope_type": "freq_factors", "factors": factors}, 128)
    assert attn == 1.0
    assert torch.allclose(scaled, base / torch.tensor(factors))
