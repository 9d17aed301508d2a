"""Kimi Linear (KDA layers beside NoPE MLA layers, DeepSeek-V3's MoE) through the engine,
token-exact against transformers.

A tiny random ``KimiLinearForCausalLM`` is built and saved with transformers (its files use
Moonshot's names: ``block_sparse_moe``, per-part ``q/k/v_conv1d``); tripod loads the folder and its
greedy tokens are compared with transformers' on the same weights: each prompt alone, all in one
batch, with prefill chunks shorter than the prompts, and resumed from the prefix cache (a state
snapshot on a radix node: the next turn extends the previous prompt and answer). (Logprobs are not
compared bit for bit across modes: the MLA layers' attention runs on torch's ops, whose sums depend
on the rows of a call, as for DeepSeek; the KDA mixer alone is bit-exact, ``tests/layers/test_kda.py``.)
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import HFReference, check_greedy_tokens
from tripod import Engine, SamplingParams
from tripod.models.config import ModelConfig

VOCAB = 256
N_TOKENS = 10
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


def _save(model: Any, folder: Path) -> tuple[Path, HFReference]:
    """The model and a word-level tokenizer of its vocabulary (Kimi's own needs tiktoken; the
    tests speak token ids) in ``folder``."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    model.save_pretrained(str(folder))
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="t0", pad_token="t0", bos_token="t1",
                            eos_token="t2").save_pretrained(str(folder))
    return folder, HFReference(model)


@pytest.fixture(scope="module")
def kimi(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, HFReference]:
    return _save(build_kimi(), tmp_path_factory.mktemp("kimi_linear"))


def _engine(folder: Path, **kw: Any) -> Engine:
    args: dict[str, Any] = dict(dtype="float32", kv_cache_tokens=1024, chunk_size=64, max_batch_tokens=128,
                                max_running=4, kernels="optimized")
    return Engine(model=str(folder), **{**args, **kw})


def _check_modes(folder: Path, ref: HFReference, what: str) -> None:
    """Every prompt alone, batched, chunked (6-token chunks) and the next turn of the first resumed
    from the prefix cache, each token for token against transformers' greedy decoding."""
    eng = _engine(folder)
    assert eng.model_config.architecture == "KimiLinearForCausalLM"
    for i, p in enumerate(PROMPTS):
        check_greedy_tokens(eng.generate([p], PARAMS)[0].token_ids, ref.greedy(p, N_TOKENS), f"{what}: prompt {i} alone")
    for i, out in enumerate(eng.generate(PROMPTS, PARAMS)):
        check_greedy_tokens(out.token_ids, ref.greedy(PROMPTS[i], N_TOKENS), f"{what}: prompt {i} batched")
    chunked = _engine(folder, chunk_size=6, max_batch_tokens=16)
    for i, out in enumerate(chunked.generate(PROMPTS, PARAMS)):
        check_greedy_tokens(out.token_ids, ref.greedy(PROMPTS[i], N_TOKENS), f"{what}: prompt {i} chunked")
    # the next turn extends a finished request's prompt + answer: resumed from its state snapshot
    # (taken where the answer's last computed token left every KDA layer) and the MLA latents
    turn = PROMPTS[0] + chunked.generate([PROMPTS[0]], PARAMS)[0].token_ids + PROMPTS[1]
    (ext,) = chunked.generate([turn], PARAMS)
    assert ext.cached_tokens == len(PROMPTS[0]) + N_TOKENS - 1  # all but the answer's last token
    check_greedy_tokens(ext.token_ids, ref.greedy(turn, N_TOKENS), f"{what}: next turn from the prefix cache")
    for e in (eng, chunked):
        e.assert_consistent()


def test_kimi_linear_matches_transformers(kimi: tuple[Path, HFReference]) -> None:
    """KDA, NoPE MLA and V3's MoE (sigmoid scores, correction bias, two expert groups): greedy tokens
    equal transformers' alone, batched, chunked and from the prefix cache."""
    folder, ref = kimi
    _check_modes(folder, ref, "kimi linear")


@pytest.mark.slow  # about 60 s on 2 cores
def test_kimi_linear_low_rank_query_and_moonshot_config(tmp_path: Path) -> None:
    """A low-rank query (``q_a_proj`` + its norm), five layers, and the config as Moonshot's own
    checkpoints write it: the layers named 1-indexed in ``linear_attn_config`` and the MLP's kind
    by ``first_k_dense_replace`` (no ``layer_types`` / ``mlp_layer_types``)."""
    types = ["linear_attention", "linear_attention", "full_attention", "linear_attention", "full_attention"]
    model = build_kimi(seed=5, num_hidden_layers=5, q_lora_rank=24, layer_types=types,
                       mlp_layer_types=["dense", "dense", "sparse", "sparse", "sparse"])
    folder, ref = _save(model, tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    for key in ("layer_types", "mlp_layer_types"):
        del cfg[key]
    cfg["first_k_dense_replace"] = 2
    cfg["linear_attn_config"].update(kda_layers=[1, 2, 4], full_attn_layers=[3, 5])
    (folder / "config.json").write_text(json.dumps(cfg))
    _check_modes(folder, ref, "kimi linear, low-rank query")


def test_moonshot_config_keys() -> None:
    """Moonshot's config.json (its own key names, layers 1-indexed in ``linear_attn_config``, dense
    MLPs by ``first_k_dense_replace``) reads as transformers reads it; a bad layer list is refused."""
    from transformers import KimiLinearConfig

    d = dict(architectures=["KimiLinearForCausalLM"], model_type="kimi_linear", vocab_size=VOCAB, hidden_size=64,
             intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=5, num_attention_heads=4,
             num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16,
             v_head_dim=16, num_experts=8, num_experts_per_token=2, num_shared_experts=1, num_expert_group=2,
             moe_renormalize=False, topk_group=1, first_k_dense_replace=2, model_max_length=4096,
             routed_scaling_factor=2.5, linear_attn_config={"head_dim": 16, "num_heads": 2, "short_conv_kernel_size": 3,
                                                            "kda_layers": [1, 2, 4], "full_attn_layers": [3, 5]})
    mc = ModelConfig.from_hf_dict(d)
    hf = KimiLinearConfig(**{k: v for k, v in d.items() if k != "architectures"})
    assert mc.hybrid is not None and mc.moe is not None and mc.mla is not None
    assert [("linear_attention" if mc.hybrid.is_linear(i) else "full_attention") for i in range(5)] == hf.layer_types
    assert [("sparse" if mc.is_moe_layer(i) else "dense") for i in range(5)] == hf.mlp_layer_types
    assert (mc.moe.num_experts, mc.moe.top_k, mc.moe.n_group, mc.moe.norm_topk_prob) == (8, 2, 2, False)
    assert mc.moe.shared_intermediate_size == 32 and mc.moe.routed_scaling_factor == 2.5
    assert (mc.hybrid.k_heads, mc.hybrid.k_dim, mc.hybrid.conv_kernel) == (2, 16, 3)
    assert mc.mla.nope and not mc.mla.rope_interleave and mc.max_position_embeddings == 4096
    assert mc.pool_spec().num_layers == 2 and not mc.norm_offset
    with pytest.raises(ValueError, match="layer_types"):
        ModelConfig.from_hf_dict({**d, "layer_types": ["linear_attention", "mamba"] + ["full_attention"] * 3})


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
    # n-gram / draft speculation run (tests/models/test_kimi_minimax_speculative.py); self:K
    # would advance the target's own KDA states while drafting
    with pytest.raises(ValueError, match="self:K"):
        _engine(folder, speculative="self:1")
