"""KV bytes per token: MLA's latent pool and DeepSeek-V4's compressed rows against the same models
with their attention expanded (every head's K and V stored), from the models' published config
shapes (V4: transformers' ``DeepseekV4Config`` defaults, which describe DeepSeek-V4-Flash).

    .venv/bin/python benchmarks/kv_bytes.py > benchmarks/results/kv_bytes.md
"""

from __future__ import annotations

import torch

from tripod.models.config import ModelConfig

_MLA = dict(qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, kv_lora_rank=512)
CONFIGS = {
    "DeepSeek-V3 / R1 (61 layers, 128 heads)": dict(
        model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], hidden_size=7168,
        intermediate_size=18432, num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128,
        vocab_size=129280, q_lora_rank=1536, n_routed_experts=256, num_experts_per_tok=8,
        moe_intermediate_size=2048, n_shared_experts=1, first_k_dense_replace=3, n_group=8, topk_group=4, **_MLA),
    "DeepSeek-V3.2 (61 layers, 128 heads; + indexer key 128)": dict(
        model_type="deepseek_v32", architectures=["DeepseekV32ForCausalLM"], hidden_size=7168,
        intermediate_size=18432, num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128,
        vocab_size=129280, q_lora_rank=1536, n_routed_experts=256, num_experts_per_tok=8,
        moe_intermediate_size=2048, n_shared_experts=1, first_k_dense_replace=3, n_group=8, topk_group=4,
        index_n_heads=64, index_head_dim=128, index_topk=2048, **_MLA),
    "DeepSeek-V2-Lite (27 layers, 16 heads)": dict(
        model_type="deepseek_v2", architectures=["DeepseekV2ForCausalLM"], hidden_size=2048,
        intermediate_size=10944, num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16,
        vocab_size=102400, q_lora_rank=None, n_routed_experts=64, num_experts_per_tok=6,
        moe_intermediate_size=1408, n_shared_experts=2, first_k_dense_replace=1, **_MLA),
    "gpt-oss-120b (GQA: 36 layers, 8 KV heads of 64)": dict(
        model_type="gpt_oss", architectures=["GptOssForCausalLM"], hidden_size=2880, intermediate_size=2880,
        num_hidden_layers=36, num_attention_heads=64, num_key_value_heads=8, head_dim=64, vocab_size=201088,
        num_local_experts=128, num_experts_per_tok=4, sliding_window=128),
    "DeepSeek-V4-Flash (43 layers, 64 heads; CSA/HCA)": dict(
        model_type="deepseek_v4", architectures=["DeepseekV4ForCausalLM"], hidden_size=4096,
        moe_intermediate_size=2048, num_hidden_layers=43, num_attention_heads=64, num_key_value_heads=1,
        head_dim=512, q_lora_rank=1024, vocab_size=129280, n_routed_experts=256, num_experts_per_tok=6,
        n_shared_experts=1, o_groups=8, o_lora_rank=1024, index_n_heads=64, index_head_dim=128, index_topk=512,
        sliding_window=128, partial_rotary_factor=64 / 512),
    "Llama-3-8B (GQA: 32 layers, 8 KV heads of 128)": dict(
        model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256),
}


def main() -> None:
    dt = torch.bfloat16
    print("| model | tripod's pool | bytes/token (bf16) | same model, attention expanded | ratio |")
    print("|---|---|---|---|---|")
    for name, d in CONFIGS.items():
        cfg = ModelConfig.from_hf_dict(d)
        ours, mha = cfg.pool_spec(), cfg.mha_equivalent_spec()
        kind = f"latent {ours.latent_dim}/layer" if ours.kind == "latent" else f"K+V {ours.num_kv_heads}x{ours.head_dim}/layer"
        if cfg.v4 is not None:
            kind = f"V4 rows {ours.latent_dim}/layer"
        b, m = ours.bytes_per_token(dt), mha.bytes_per_token(dt)
        print(f"| {name} | {kind} | {b:,} | {m:,} | {m / b:.1f}x |")
    v4_detail(dt)


def v4_detail(dt: torch.dtype) -> None:
    """DeepSeek-V4: what tripod's rows hold per layer kind, against what the design needs per token
    once blocks are closed and keys have left the window (the compressed entries only)."""
    name = next(n for n in CONFIGS if "V4" in n)
    cfg = ModelConfig.from_hf_dict(CONFIGS[name])
    assert cfg.v4 is not None
    a, size = cfg.v4.attn, torch.tensor([], dtype=dt).element_size()
    kinds = a.kinds
    print()
    print(f"{name}: {kinds.count('sliding')} sliding, {kinds.count('csa')} CSA, {kinds.count('hca')} HCA layers")
    print()
    print("| layer kind | row parts (values) | tripod's row | long-context need per token |")
    print("|---|---|---|---|")
    for kind in ("sliding", "csa", "hca"):
        parts = ", ".join(f"{n} {w}" for n, (_, w) in a.layout(kind).items())
        print(f"| {kind} | {parts} | {a.row(kind)} | {a.steady_values(kind):g} |")
    stored = sum(a.row_dim for _ in kinds) * size
    steady = sum(a.steady_values(k) for k in kinds) * size
    window = len(kinds) * a.window * a.head_dim * size
    mha = cfg.mha_equivalent_spec().bytes_per_token(dt)
    print()
    print(f"tripod's pool (every layer's row as wide as the widest, {a.row_dim}): {stored:,} bytes/token (bf16), "
          f"{mha / stored:.1f}x under MHA ({mha:,}).")
    print(f"The design's long-context need: {steady:,.0f} bytes/token (entries and indexer keys over their "
          f"blocks) plus a fixed {window:,} bytes per sequence for the {a.window}-token windows: {mha / steady:,.0f}x under MHA.")


if __name__ == "__main__":
    main()
