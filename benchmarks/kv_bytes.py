"""KV bytes per token: MLA's latent pool against the same models with their attention expanded
(every head's K and V stored), from the models' published config shapes.

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
        b, m = ours.bytes_per_token(dt), mha.bytes_per_token(dt)
        print(f"| {name} | {kind} | {b:,} | {m:,} | {m / b:.1f}x |")


if __name__ == "__main__":
    main()
