"""Kimi Linear (KDA layers beside NoPE MLA layers, DeepSeek-V3's MoE) through the engine,
token-exact against transformers.

A tiny random ``KimiLinearForCausalLM`` is built and saved with transformers (its files use
Moonshot's names: ``block_sparse_moe``, per-part ``q/k/v_conv1d``); tripod loads the folder and its
greedy tokens are compared with transformers' on the same weights: each prompt alone, all in one
batch, with prefill chunks shorter than the prompts, and resumed from the prefix cache (a state
snapshot on a radix node: the next turn extends the previous prompt and answer). With dense MLPs
on every layer (the MoE's expert matmuls group a step's rows, as for every MoE family) tripod's
CPU kernels also give the same logprobs bit for bit alone, batched, chunked and cached.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import HFReference, check_greedy_tokens
from tripod import Engine, SamplingParams

VOCAB = 256
N_TOKENS = 12
LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
CONFIG: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
    qk_nope_head_dim=16, v_head_dim=16, num_local_experts=4, num_experts_per_tok=2, n_shared_experts=1,
    n_group=2, topk_group=1, routed_scaling_factor=1.5, layer_types=LAYER_TYPES,
    mlp_layer_types=["dense", "sparse", "sparse", "sparse"], max_position_embeddings=512,
    linear_attn_config={"head_dim": 8, "num_heads": 4, "short_conv_kernel_size": 4},
    bos_token_id=1, eos_token_id=2, pad_token_id=0,
)


def build_kimi(seed: int = 0, **overrides: Any) -> Any:
    """transformers' Kimi Linear (fp32, eval) with decisive random weights: unit-variance
    projections, norms around one, decays and conv taps of real size, router biases off zero."""
    from transformers import AutoModelForCausalLM, KimiLinearConfig

    cfg = KimiLinearConfig(**{**CONFIG, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "conv1d" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif name.endswith("A_log") or name.endswith("dt_bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif p.ndim >= 2:
                std = 1.0 if "embed" in name else (3.0 if "lm_head" in name else 1.0) / math.sqrt(p.shape[-1])
                p.copy_(torch.randn(p.shape, generator=g) * std)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
    model.eval()
    return model


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (37, 5, 22)]


PROMPTS = _prompts()
PARAMS = SamplingParams(max_tokens=N_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)


def _save(model: Any, folder: Path, tokenizer: Any) -> tuple[Path, HFReference]:
    model.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))  # (Kimi's own is tiktoken's; any will do for token ids)
    return folder, HFReference(model)


@pytest.fixture(scope="module")
def kimi(tmp_path_factory: pytest.TempPathFactory, hf_tokenizer: Any) -> tuple[Path, HFReference]:
    return _save(build_kimi(), tmp_path_factory.mktemp("kimi_linear"), hf_tokenizer)


@pytest.fixture(scope="module")
def kimi_dense(tmp_path_factory: pytest.TempPathFactory, hf_tokenizer: Any) -> tuple[Path, HFReference]:
    return _save(build_kimi(seed=3, mlp_layer_types=["dense"] * 4), tmp_path_factory.mktemp("kimi_linear_dense"),
                 hf_tokenizer)


def _engine(folder: Path, **kw: Any) -> Engine:
    args: dict[str, Any] = dict(dtype="float32", kv_cache_tokens=1024, chunk_size=64, max_batch_tokens=128,
                                max_running=4, kernels="optimized")
    return Engine(model=str(folder), **{**args, **kw})


def _logprobs(out: Any) -> list[float]:
    return [lp.logprob for lp in out.logprobs]


def _modes(folder: Path, ref: HFReference, what: str) -> dict[str, list[Any]]:
    """Every prompt alone, batched, chunked (6-token chunks) and from the prefix cache, each checked
    against transformers' greedy tokens; the outputs by mode."""
    refs = [ref.greedy(p, N_TOKENS) for p in PROMPTS]
    eng = _engine(folder)
    assert eng.model_config.architecture == "KimiLinearForCausalLM"
    outs: dict[str, list[Any]] = {"alone": [eng.generate([p], PARAMS)[0] for p in PROMPTS]}
    outs["batched"] = eng.generate(PROMPTS, PARAMS)
    outs["chunked"] = _engine(folder, chunk_size=6, max_batch_tokens=16).generate(PROMPTS, PARAMS)
    # the next turn extends a finished request's prompt + answer: resumed from its state snapshot
    cached = _engine(folder, chunk_size=8, max_batch_tokens=32)
    first = cached.generate([PROMPTS[0]], PARAMS)[0]
    assert first.cached_tokens == 0
    turn = PROMPTS[0] + first.token_ids + PROMPTS[1]
    (ext,) = cached.generate([turn], PARAMS)
    assert ext.cached_tokens == len(PROMPTS[0]) + N_TOKENS - 1  # all but the answer's last token
    outs["cached"] = [ext]
    outs["cold"] = _engine(folder, chunk_size=8, max_batch_tokens=32, enable_prefix_cache=False).generate([turn], PARAMS)
    check_greedy_tokens(ext.token_ids, ref.greedy(turn, N_TOKENS), f"{what}: next turn from the cache")
    for mode in ("alone", "batched", "chunked"):
        for i, out in enumerate(outs[mode]):
            check_greedy_tokens(out.token_ids, refs[i], f"{what}: prompt {i} {mode}")
    for e in (eng, cached):
        e.assert_consistent()
    return outs


def test_kimi_linear_matches_transformers(kimi: tuple[Path, HFReference]) -> None:
    """MoE layers (V3 routing: sigmoid, correction bias, two groups), KDA and NoPE MLA: greedy tokens
    equal transformers' alone, batched, chunked and from the prefix cache."""
    folder, ref = kimi
    outs = _modes(folder, ref, "kimi linear")
    assert outs["cached"][0].token_ids == outs["cold"][0].token_ids


def test_kimi_linear_dense_is_bit_exact_across_modes(kimi_dense: tuple[Path, HFReference]) -> None:
    """Dense MLPs: on tripod's CPU kernels a prompt's logprobs are the same bits alone, batched,
    chunked and resumed from a state snapshot."""
    folder, ref = kimi_dense
    outs = _modes(folder, ref, "kimi linear dense")
    if not _engine(folder).runner.uses_kernels:
        pytest.skip("tripod's CPU kernels are not built here (the bitwise path)")
    for mode in ("batched", "chunked"):
        for i, out in enumerate(outs[mode]):
            assert out.token_ids == outs["alone"][i].token_ids
            assert _logprobs(out) == _logprobs(outs["alone"][i]), f"prompt {i}: {mode} logprobs differ from alone"
    assert _logprobs(outs["cached"][0]) == _logprobs(outs["cold"][0])


def test_kimi_linear_pools(kimi: tuple[Path, HFReference]) -> None:
    """The latent pool holds the two MLA layers only; the state pool each KDA layer's conv window
    (q, k, v: 3 x 4 heads x 8) and recurrent state (4 heads x 8 x 8), float32."""
    folder, _ = kimi
    eng = _engine(folder)
    mc = eng.model_config
    assert mc.mla is not None and mc.mla.nope and mc.hybrid is not None and mc.hybrid.linear_layers == (0, 2)
    assert mc.moe is not None and mc.moe.dense_layers == (0,) and mc.moe.scoring == "sigmoid"
    assert eng.pool.kv.shape[0] == 2
    assert eng.states is not None and eng.states.spec.layers == (((96, 3), (4, 8, 8)),) * 2
    with pytest.raises(ValueError, match="hybrid"):
        _engine(folder, speculative="ngram")
