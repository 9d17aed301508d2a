"""Kimi Linear GGUFs (llama.cpp's ``kimi-linear``) read back into transformers' layout.

llama.cpp's converter takes Moonshot's checkpoint layout (a dense layer's MLP under ``mlp``) and
rewrites it on the way in; this module undoes each rewrite (``loader/gguf_hybrid.py`` does the same
for the other hybrids), so ``KimiLinearForCausalLM`` sees the HF folder's tensors:

- the KDA layers (``attention.head_count_kv`` 0): ``ssm_a`` is ``-exp(A_log)``, handed over as
  ``self_attn.A`` (used in its place, bit for bit; a logarithm would not round-trip); the three
  short convs stored ``[1, C, 1, K]`` are given as ``[C, K]``;
- the MLA layers: ``kv_b_proj`` is stored split per head into ``attn_k_b`` (transposed, ``[H, r, nope]``)
  and ``attn_v_b`` (``[H, v, r]``): joined back (a transpose and a concatenation, exact);
- MoE experts stacked ``[E, rows, cols]`` (given as transformers' ``gate_up_proj`` / ``down_proj``).

Two things the file does not record are read as Moonshot's checkpoints have them: the expert group
count (``expert_group_count`` when written, else 1) and the KDA head count (``attn_q``'s rows of a
KDA layer / ``kda.head_dim``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tripod.loader.gguf_hybrid import Entry, GGUFSource, as_stored, flattened

ARCH = "kimi-linear"
_KDA = {
    "attn_q.weight": "q_proj.weight", "attn_k.weight": "k_proj.weight", "attn_v.weight": "v_proj.weight",
    "attn_output.weight": "o_proj.weight", "ssm_conv1d_q.weight": "q_conv1d.weight",
    "ssm_conv1d_k.weight": "k_conv1d.weight", "ssm_conv1d_v.weight": "v_conv1d.weight", "ssm_a": "A",
    "ssm_dt.bias": "dt_bias", "ssm_f_a.weight": "f_a_proj.weight", "ssm_f_b.weight": "f_b_proj.weight",
    "ssm_beta.weight": "b_proj.weight", "ssm_g_a.weight": "g_a_proj.weight", "ssm_g_b.weight": "g_b_proj.weight",
    "ssm_norm.weight": "o_norm.weight",
}
_MLA = {
    "attn_q.weight": "q_proj.weight", "attn_q_a.weight": "q_a_proj.weight", "attn_q_a_norm.weight": "q_a_layernorm.weight",
    "attn_q_b.weight": "q_b_proj.weight", "attn_kv_a_mqa.weight": "kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "kv_a_layernorm.weight", "attn_output.weight": "o_proj.weight",
}
_LAYER = {
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight", "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight", "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight", "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
}
_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}


def _kv_heads(f: GGUFSource) -> list[int]:
    kv = f.field(f"{ARCH}.attention.head_count_kv")
    layers = int(f.field(f"{ARCH}.block_count"))
    return [int(k) for k in kv] if isinstance(kv, list) else [int(kv or 0)] * layers


def hf_config(f: GGUFSource) -> dict[str, Any]:
    """The HF ``config.json`` dict (transformers' Kimi Linear keys) of a ``kimi-linear`` GGUF."""

    def g(key: str, default: Any = None) -> Any:
        return f.field(f"{ARCH}.{key}", default)

    by_name = {t.name: t for t in f.reader.tensors}
    kv = _kv_heads(f)
    layers, heads = len(kv), int(g("attention.head_count"))
    kda = next(i for i, k in enumerate(kv) if k == 0)
    kda_dim = int(g("kda.head_dim"))
    rope = int(g("rope.dimension_count"))
    dense = int(g("leading_dense_block_count", 0) or 0)
    q_a = by_name.get(f"blk.{kv.index(max(kv))}.attn_q_a.weight")
    eos, bos = f.field("tokenizer.ggml.eos_token_id"), f.field("tokenizer.ggml.bos_token_id")
    return dict(
        model_type="kimi_linear", architectures=["KimiLinearForCausalLM"],
        vocab_size=int(g("vocab_size", 0) or by_name["token_embd.weight"].shape[-1]),
        hidden_size=int(g("embedding_length")), intermediate_size=int(g("feed_forward_length")),
        moe_intermediate_size=int(g("expert_feed_forward_length")), num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads,  # (the converter writes MQA's 1 for its own kernel)
        kv_lora_rank=int(g("attention.kv_lora_rank")), q_lora_rank=None if q_a is None else int(q_a.shape[1]),
        qk_rope_head_dim=rope, qk_nope_head_dim=int(g("attention.key_length_mla")) - rope,
        v_head_dim=int(g("attention.value_length_mla")),
        num_experts=int(g("expert_count")), num_experts_per_token=int(g("expert_used_count")),
        num_shared_experts=int(g("expert_shared_count", 1)), num_expert_group=int(g("expert_group_count", 1) or 1),
        topk_group=int(g("expert_group_used_count", 1) or 1), routed_scaling_factor=float(g("expert_weights_scale", 1.0)),
        moe_renormalize=bool(g("expert_weights_norm", True)),
        layer_types=["full_attention" if k else "linear_attention" for k in kv],
        mlp_layer_types=["dense" if i < dense else "sparse" for i in range(layers)],
        linear_attn_config={"head_dim": kda_dim, "num_heads": int(by_name[f"blk.{kda}.attn_q.weight"].shape[1]) // kda_dim,
                            "short_conv_kernel_size": int(g("ssm.conv_kernel", 4))},
        rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-5)), hidden_act="silu",
        max_position_embeddings=int(g("context_length", 2048)), tie_word_embeddings="output.weight" not in by_name,
        bos_token_id=int(bos) if bos is not None else None, eos_token_id=int(eos) if eos is not None else None,
    )


def entries(f: GGUFSource, cfg: dict[str, Any]) -> dict[str, Entry]:
    """Every tensor ``KimiLinearForCausalLM`` reads, by HF name."""
    kv = _kv_heads(f)
    by_name = {t.name: t for t in f.reader.tensors}
    nope, v = cfg["qk_nope_head_dim"], cfg["v_head_dim"]
    out: dict[str, Entry] = {}
    for t in f.reader.tensors:
        if t.name in _GLOBAL:
            out[_GLOBAL[t.name]] = Entry((t,), as_stored)
            continue
        if not t.name.startswith("blk."):
            continue
        _, idx, rest = t.name.split(".", 2)
        i = int(idx)
        attn = _MLA if kv[i] else _KDA
        p = f"model.layers.{i}."
        if rest in attn:
            flat = rest.startswith("ssm_conv1d") or rest == "ssm_a"
            out[p + "self_attn." + attn[rest]] = Entry((t,), _conv if rest.startswith("ssm_conv1d") else
                                                       (flattened if flat else as_stored))
        elif rest in _LAYER:
            out[p + _LAYER[rest]] = Entry((t,), as_stored)
            if rest == "ffn_down_exps.weight":
                pair = (by_name[f"blk.{i}.ffn_gate_exps.weight"], by_name[f"blk.{i}.ffn_up_exps.weight"])
                out[p + "mlp.experts.gate_up_proj"] = Entry(pair, as_stored)
        elif rest == "attn_k_b.weight":
            pair = (t, by_name[f"blk.{i}.attn_v_b.weight"])
            out[p + "self_attn.kv_b_proj.weight"] = Entry(pair, as_stored, join=_kv_b(nope, v))
    return out


def _kv_b(nope: int, v: int) -> Any:
    def join(parts: list[np.ndarray]) -> np.ndarray:
        k_b, v_b = parts  # [H, r, nope] (transposed by the converter), [H, v, r]
        h, r = k_b.shape[0], k_b.shape[1]
        assert k_b.shape[2] == nope and v_b.shape[1] == v
        return np.concatenate((k_b.transpose(0, 2, 1), v_b), axis=1).reshape(h * (nope + v), r)

    return join


def _conv(w: np.ndarray) -> np.ndarray:
    return w.reshape(w.shape[1], w.shape[3])
