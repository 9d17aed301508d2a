"""Hybrid GGUFs (llama.cpp's ``qwen35``, ``qwen35moe``, ``qwen3next``, ``lfm2``, ``nemotron_h``,
``nemotron_h_moe``, ``granitehybrid``) read back into transformers' layout.

llama.cpp's converter (``convert_hf_to_gguf.py``) rewrites these checkpoints on the way in; this module
undoes each rewrite so the models see exactly the tensors the HF folder holds (what ``ModelConfig.from_hf_dict``
and the models' ``load_weights`` already read):

- the metadata becomes the HF config dict (``hf_config``): layer types from ``attention.recurrent_layers``,
  the Gated DeltaNet geometry from the ``ssm.*`` keys, partial rotary from ``rope.dimension_count``;
- every RMSNorm outside the mixer is stored as ``1 + w`` (the converter adds the 1): ``w`` is given back
  as ``(1 + w) - 1``, which the models' ``1 + w`` fold turns into the file's value again exactly
  (Sterbenz: exact for every scale ``1 + w >= 0.5``);
- ``ssm_a`` is ``-exp(A_log)``: handed over as it is, under the name ``linear_attn.A`` (the mixer uses it
  in place of ``-exp(A_log)``, bit for bit what torch's ``exp`` gives; a logarithm would not round-trip);
- Qwen3.5 with fewer key heads than value heads: the converter reorders the value heads from grouped
  by key head to tiled (``_reorder_v_heads``) in ``in_proj_qkv``'s V rows, ``in_proj_z``, ``_a``, ``_b``,
  ``A_log``, ``dt_bias``, the conv's V channels and ``out_proj``'s columns: undone here (rows: a
  gather; ``out_proj``'s stored blocks keep the file's column order and read their input permuted);
- Qwen3-Next's ``in_proj_qkvz`` / ``in_proj_ba`` (rows grouped per key head) arrive as ``attn_qkv`` and
  ``attn_gate`` (already Qwen3.5's ``in_proj_qkv`` / ``in_proj_z`` layout) and ``ssm_ba`` (still grouped:
  split here into ``in_proj_b`` / ``in_proj_a`` by rows);
- LFM2: tensors renamed only (its conv squeezed to ``[channels, L]``); the config's MLP width is
  written already derived (``block_auto_adjust_ff_dim`` off here), its attention layers are the
  ones with a nonzero ``attention.head_count_kv``;
- Nemotron-H / Granite 4.0-H (Mamba2 hybrids, ``_mamba2_config`` / ``_mamba2_entries``): ``ssm_a`` is
  ``-exp(A_log)`` (handed over as ``mixer.A`` / ``mamba.A``, as above), ``ssm_d`` and the gated norm
  flattened back, attention Q/K rows un-permuted (the converter applies llama.cpp's rotary pair order
  to them, RoPE or not), Granite's split gate / up concatenated back into ``input_linear``;
- ``ssm_conv1d`` is squeezed to ``[channels, K]``; MoE experts are stacked ``[E, rows, cols]`` (given as
  transformers' stacked ``gate_up_proj`` / ``down_proj``); the shared expert's gate is 1-D.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np


class GGUFSource(Protocol):
    """What this module reads of an open GGUF (``loader/gguf_loader.GGUFFile``)."""

    arch: str
    reader: Any

    def field(self, key: str, default: Any = None) -> Any: ...

# GGUF architecture -> (HF model_type, HF architecture)
HYBRID_ARCHS = {
    "qwen35": ("qwen3_5_text", "Qwen3_5ForCausalLM"),
    "qwen35moe": ("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM"),
    "qwen3next": ("qwen3_next", "Qwen3NextForCausalLM"),
    "lfm2": ("lfm2", "Lfm2ForCausalLM"),
    "nemotron_h": ("nemotron_h", "NemotronHForCausalLM"),
    "nemotron_h_moe": ("nemotron_h", "NemotronHForCausalLM"),  # (the converter's name when there are MoE layers)
    "granitehybrid": ("granitemoehybrid", "GraniteMoeHybridForCausalLM"),
}
MAMBA2_ARCHS = ("nemotron_h", "nemotron_h_moe", "granitehybrid")
# The Mamba2 mixer's tensors (both Mamba2 hybrids): the converter renames them, stores ``A`` as
# -exp(A_log) (``[H, 1]``), ``D`` as ``[H, 1]`` and the gated norm as ``[groups, channels / groups]``.
_MAMBA2 = {
    "ssm_in.weight": "in_proj.weight", "ssm_in.bias": "in_proj.bias",
    "ssm_out.weight": "out_proj.weight", "ssm_out.bias": "out_proj.bias",
    "ssm_conv1d.weight": "conv1d.weight", "ssm_conv1d.bias": "conv1d.bias",
    "ssm_dt.bias": "dt_bias", "ssm_a": "A", "ssm_d": "D", "ssm_norm.weight": "norm.weight",
}
_FLAT = ("ssm_a", "ssm_d", "ssm_norm.weight")  # stored with an extra axis: flattened back
# Nemotron-H (``backbone.`` on disk; tripod's model reads it as ``model.``): one mixer per layer,
# which is the Mamba2 mixer, the attention, the MLP or the MoE.
_NEMOTRON_NAMES: dict[str, str] = {
    "attn_norm.weight": "norm.weight",
    **{f"attn_{g}.weight": f"mixer.{h}_proj.weight" for g, h in (("q", "q"), ("k", "k"), ("v", "v"), ("output", "o"))},
    **{g: f"mixer.{h}" for g, h in _MAMBA2.items()},
    "ffn_up.weight": "mixer.up_proj.weight", "ffn_down.weight": "mixer.down_proj.weight",
    "ffn_up.bias": "mixer.up_proj.bias", "ffn_down.bias": "mixer.down_proj.bias",
    "ffn_gate_inp.weight": "mixer.gate.weight", "exp_probs_b.bias": "mixer.gate.e_score_correction_bias",
    "ffn_up_exps.weight": "mixer.experts.up_proj", "ffn_down_exps.weight": "mixer.experts.down_proj",
    "ffn_up_shexp.weight": "mixer.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mixer.shared_experts.down_proj.weight",
}
_NEMOTRON_GLOBAL = {"token_embd.weight": "model.embeddings.weight", "output_norm.weight": "model.norm_f.weight",
                    "output.weight": "lm_head.weight"}
# Granite 4.0 hybrid: the converter splits the shared MLP's and the experts' gate|up (``input_linear``)
# in two; they are concatenated back (rows) here.
_GRANITE_NAMES: dict[str, str] = {
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    **{f"attn_{g}.weight": f"self_attn.{h}_proj.weight" for g, h in (("q", "q"), ("k", "k"), ("v", "v"), ("output", "o"))},
    **{g: f"mamba.{h}" for g, h in _MAMBA2.items()},
    "ffn_gate_inp.weight": "block_sparse_moe.router.layer.weight",
    "ffn_down_exps.weight": "block_sparse_moe.output_linear.weight",
    "ffn_down_shexp.weight": "shared_mlp.output_linear.weight", "ffn_down.weight": "shared_mlp.output_linear.weight",
}
_GRANITE_PAIRS = {  # HF name <- (gate, up) concatenated by rows
    "ffn_down_exps.weight": ("block_sparse_moe.input_linear.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight"),
    "ffn_down_shexp.weight": ("shared_mlp.input_linear.weight", "ffn_gate_shexp.weight", "ffn_up_shexp.weight"),
    "ffn_down.weight": ("shared_mlp.input_linear.weight", "ffn_gate.weight", "ffn_up.weight"),
}
_GRANITE_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                   "output.weight": "lm_head.weight"}
# LFM2 (a state-space hybrid: short-conv and attention layers): the converter renames only
_LFM2_NAMES: dict[str, tuple[str, bool]] = {
    "attn_norm.weight": ("operator_norm.weight", False),
    "ffn_norm.weight": ("ffn_norm.weight", False),
    "attn_q.weight": ("self_attn.q_proj.weight", False),
    "attn_k.weight": ("self_attn.k_proj.weight", False),
    "attn_v.weight": ("self_attn.v_proj.weight", False),
    "attn_output.weight": ("self_attn.out_proj.weight", False),
    "attn_q_norm.weight": ("self_attn.q_layernorm.weight", False),
    "attn_k_norm.weight": ("self_attn.k_layernorm.weight", False),
    "ffn_gate.weight": ("feed_forward.w1.weight", False),
    "ffn_up.weight": ("feed_forward.w3.weight", False),
    "ffn_down.weight": ("feed_forward.w2.weight", False),
    "shortconv.in_proj.weight": ("conv.in_proj.weight", False),
    "shortconv.in_proj.bias": ("conv.in_proj.bias", False),
    "shortconv.conv.weight": ("conv.conv.weight", False),
    "shortconv.conv.bias": ("conv.conv.bias", False),
    "shortconv.out_proj.weight": ("conv.out_proj.weight", False),
    "shortconv.out_proj.bias": ("conv.out_proj.bias", False),
}
_LFM2_GLOBAL = {"token_embd.weight": ("model.embed_tokens.weight", False),
                "token_embd_norm.weight": ("model.embedding_norm.weight", False),
                "output.weight": ("lm_head.weight", False)}

# blk.N.<gguf> -> model.layers.N.<hf>; the norms marked True carry llama.cpp's + 1.
_NAMES: dict[str, tuple[str, bool]] = {
    "attn_norm.weight": ("input_layernorm.weight", True),
    "post_attention_norm.weight": ("post_attention_layernorm.weight", True),
    "attn_q.weight": ("self_attn.q_proj.weight", False),
    "attn_k.weight": ("self_attn.k_proj.weight", False),
    "attn_v.weight": ("self_attn.v_proj.weight", False),
    "attn_output.weight": ("self_attn.o_proj.weight", False),
    "attn_q_norm.weight": ("self_attn.q_norm.weight", True),
    "attn_k_norm.weight": ("self_attn.k_norm.weight", True),
    "ffn_gate.weight": ("mlp.gate_proj.weight", False),
    "ffn_up.weight": ("mlp.up_proj.weight", False),
    "ffn_down.weight": ("mlp.down_proj.weight", False),
    "ffn_gate_inp.weight": ("mlp.gate.weight", False),
    "ffn_gate_shexp.weight": ("mlp.shared_expert.gate_proj.weight", False),
    "ffn_up_shexp.weight": ("mlp.shared_expert.up_proj.weight", False),
    "ffn_down_shexp.weight": ("mlp.shared_expert.down_proj.weight", False),
    "ffn_gate_inp_shexp.weight": ("mlp.shared_expert_gate.weight", False),
    "ffn_down_exps.weight": ("mlp.experts.down_proj", False),
    "attn_qkv.weight": ("linear_attn.in_proj_qkv.weight", False),
    "attn_gate.weight": ("linear_attn.in_proj_z.weight", False),
    "ssm_beta.weight": ("linear_attn.in_proj_b.weight", False),
    "ssm_alpha.weight": ("linear_attn.in_proj_a.weight", False),
    "ssm_ba.weight": ("linear_attn.in_proj_ba.weight", False),
    "ssm_a": ("linear_attn.A", False),
    "ssm_dt.bias": ("linear_attn.dt_bias", False),
    "ssm_conv1d.weight": ("linear_attn.conv1d.weight", False),
    "ssm_norm.weight": ("linear_attn.norm.weight", False),
    "ssm_out.weight": ("linear_attn.out_proj.weight", False),
}
_GLOBAL = {"token_embd.weight": ("model.embed_tokens.weight", False), "output_norm.weight": ("model.norm.weight", True),
           "output.weight": ("lm_head.weight", False)}


def hf_config(f: GGUFSource) -> dict[str, Any]:
    """The HF ``config.json`` dict of a hybrid GGUF (what ``ModelConfig.from_hf_dict`` reads)."""
    a = f.arch
    mtype, arch = HYBRID_ARCHS[a]

    def g(key: str, default: Any = None) -> Any:
        return f.field(f"{a}.{key}", default)

    names = {t.name for t in f.reader.tensors}
    embd = next(t for t in f.reader.tensors if t.name == "token_embd.weight")
    eos, bos = f.field("tokenizer.ggml.eos_token_id"), f.field("tokenizer.ggml.bos_token_id")
    if a in MAMBA2_ARCHS:
        return _mamba2_config(f, mtype, arch)
    if a == "lfm2":
        kv = g("attention.head_count_kv")
        kv = list(kv) if isinstance(kv, list) else [int(kv)] * int(g("block_count"))
        return dict(
            model_type=mtype, architectures=[arch], vocab_size=int(g("vocab_size", 0) or embd.shape[-1]),
            hidden_size=int(g("embedding_length")), num_hidden_layers=int(g("block_count")),
            num_attention_heads=int(g("attention.head_count")), num_key_value_heads=max(int(k) for k in kv),
            # the converter writes the MLP width already derived (block_auto_adjust_ff_dim applied)
            intermediate_size=int(g("feed_forward_length")), block_auto_adjust_ff_dim=False,
            layer_types=["conv" if int(k) == 0 else "full_attention" for k in kv],
            conv_L_cache=int(g("shortconv.l_cache")), conv_bias=any(n.endswith("shortconv.conv.bias") for n in names),
            norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_parameters={"rope_type": "default", "rope_theta": float(g("rope.freq_base", 10000.0))},
            max_position_embeddings=int(g("context_length", 2048)), tie_word_embeddings="output.weight" not in names,
            bos_token_id=int(bos) if bos is not None else None, eos_token_id=int(eos) if eos is not None else None,
        )
    layers = int(g("block_count")) - int(g("nextn_predict_layers", 0) or 0)  # (MTP layers are not read)
    heads, head_dim = int(g("attention.head_count")), int(g("attention.key_length"))
    recurrent = g("attention.recurrent_layers")
    if recurrent is None:
        interval = int(g("full_attention_interval", 4))
        recurrent = [(i + 1) % interval != 0 for i in range(layers)]
    v_heads = int(g("ssm.time_step_rank"))
    d: dict[str, Any] = dict(
        model_type=mtype, architectures=[arch],
        vocab_size=int(g("vocab_size", 0) or embd.shape[-1]),
        hidden_size=int(g("embedding_length")),
        num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=int(g("attention.head_count_kv", heads)), head_dim=head_dim,
        rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-6)),
        max_position_embeddings=int(g("context_length", 2048)),
        tie_word_embeddings="output.weight" not in names,
        layer_types=["linear_attention" if r else "full_attention" for r in list(recurrent)[:layers]],
        linear_num_key_heads=int(g("ssm.group_count")), linear_num_value_heads=v_heads,
        linear_key_head_dim=int(g("ssm.state_size")), linear_value_head_dim=int(g("ssm.inner_size")) // v_heads,
        linear_conv_kernel_dim=int(g("ssm.conv_kernel", 4)),
        rope_parameters={"rope_type": "default", "rope_theta": float(g("rope.freq_base", 10000.0)),
                         "partial_rotary_factor": int(g("rope.dimension_count", head_dim)) / head_dim},
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_id=int(eos) if eos is not None else None,
    )
    ff = g("feed_forward_length")
    if ff:
        d["intermediate_size"] = int(ff)
    experts = g("expert_count")
    if experts:
        dense = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in names]
        d.update(num_experts=int(experts), num_experts_per_tok=int(g("expert_used_count")),
                 moe_intermediate_size=int(g("expert_feed_forward_length")),
                 shared_expert_intermediate_size=int(g("expert_shared_feed_forward_length", 0) or 0),
                 norm_topk_prob=bool(g("expert_weights_norm", True)), mlp_only_layers=dense)
    return d


def _mamba2_kinds(f: GGUFSource, by_name: dict[str, Any]) -> tuple[list[str], list[int]]:
    """Each layer's kind (Nemotron-H's words) and ``attention.head_count_kv`` per layer."""
    a = f.arch
    layers = int(f.field(f"{a}.block_count")) - int(f.field(f"{a}.nextn_predict_layers", 0) or 0)  # (no MTP)
    kv = f.field(f"{a}.attention.head_count_kv")
    kv = [int(k) for k in kv] if isinstance(kv, list) else [int(kv or 0)] * layers
    kinds: list[str] = []
    for i in range(layers):
        attn = f"blk.{i}.attn_q.weight" in by_name
        if attn != (int(kv[i]) > 0):
            # (llama.cpp's converter reads Granite's layer kinds as "mamba" / "attention"; a config
            # written with other names gives a file whose attention layers llama.cpp cannot run either)
            raise ValueError(f"GGUF {a}: layer {i} has {'' if attn else 'no '}attention tensors but "
                             f"attention.head_count_kv {kv[i]}; re-convert it from a config whose layer types "
                             f"llama.cpp's converter reads (Granite: layer_types 'mamba' / 'attention')")
        if attn:
            kinds.append("full_attention")
        elif f"blk.{i}.ssm_in.weight" in by_name:
            kinds.append("linear_attention")
        else:
            kinds.append("moe" if f"blk.{i}.ffn_gate_inp.weight" in by_name else "mlp")
    return kinds, kv


def _mamba2_config(f: GGUFSource, mtype: str, arch: str) -> dict[str, Any]:
    """``hf_config`` of Nemotron-H and Granite 4.0 hybrid GGUFs (Mamba2, attention, MLP / MoE layers).

    A layer's kind is read as llama.cpp reads it: attention where ``attention.head_count_kv`` is
    nonzero (the converter permutes those layers' Q/K rows, undone in ``entries``), Mamba2 where it
    has ``ssm_in``, else (Nemotron-H) MoE or MLP by its tensors."""
    a = f.arch

    def g(key: str, default: Any = None) -> Any:
        return f.field(f"{a}.{key}", default)

    by_name = {t.name: t for t in f.reader.tensors}
    kinds, kv = _mamba2_kinds(f, by_name)
    layers = len(kinds)

    def rows(suffix: str) -> int | None:
        """The output rows of the first layer tensor named ``suffix`` (GGUF lists dims innermost first)."""
        t = next((t for n, t in by_name.items() if n.startswith("blk.") and n.endswith(suffix)), None)
        return None if t is None else int(t.shape[1])

    heads = int(g("attention.head_count"))
    hidden = int(g("embedding_length"))
    m_heads, inner = int(g("ssm.time_step_rank")), int(g("ssm.inner_size"))
    eos, bos = f.field("tokenizer.ggml.eos_token_id"), f.field("tokenizer.ggml.bos_token_id")
    d: dict[str, Any] = dict(
        model_type=mtype, architectures=[arch],
        vocab_size=int(g("vocab_size", 0) or by_name["token_embd.weight"].shape[-1]),
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=max([int(k) for k in kv] + [1]),
        max_position_embeddings=int(g("context_length", 2048)),
        tie_word_embeddings="output.weight" not in by_name,
        bos_token_id=int(bos) if bos is not None else None, eos_token_id=int(eos) if eos is not None else None,
    )
    conv_bias = any(n.endswith("ssm_conv1d.bias") for n in by_name)
    proj_bias = any(n.endswith("ssm_in.bias") for n in by_name)
    eps = float(g("attention.layer_norm_rms_epsilon", None) or g("attention.layer_norm_epsilon", 1e-5))
    experts = int(g("expert_count", 0) or 0)
    if a == "granitehybrid":
        d.update(
            layer_types=["attention" if k == "full_attention" else "mamba" for k in kinds],
            mamba_n_heads=m_heads, mamba_d_head=inner // m_heads, mamba_expand=inner / hidden,
            mamba_n_groups=int(g("ssm.group_count")), mamba_d_state=int(g("ssm.state_size")),
            mamba_d_conv=int(g("ssm.conv_kernel")), mamba_conv_bias=conv_bias, mamba_proj_bias=proj_bias,
            rms_norm_eps=eps, hidden_act="silu",
            intermediate_size=int(g("feed_forward_length", 0) or 0),
            shared_intermediate_size=rows("ffn_up_shexp.weight") or rows("ffn_up.weight") or 0,
            num_local_experts=experts, num_experts_per_tok=int(g("expert_used_count", 0) or 0),
            embedding_multiplier=float(g("embedding_scale", 1.0)), logits_scaling=float(g("logit_scale", 1.0)),
            residual_multiplier=float(g("residual_scale", 1.0)), attention_multiplier=float(g("attention.scale", 1.0)),
            # the converter writes rope.scaling.finetuned True where the attention has RoPE (Bamba);
            # Granite 4.0-H attends without positions
            position_embedding_type="rope" if g("rope.scaling.finetuned") else None,
            rope_theta=float(g("rope.freq_base", 10000.0)),
        )
        return d
    if g("moe_latent_size") is not None:
        raise ValueError(f"GGUF {a}: latent MoE layers (moe_latent_size) are not read from GGUFs; "
                         f"load the HF folder")
    d.update(
        layers_block_type=kinds, head_dim=int(g("attention.key_length", hidden // max(heads, 1))),
        mamba_num_heads=m_heads, mamba_head_dim=inner // m_heads, ssm_state_size=int(g("ssm.state_size")),
        n_groups=int(g("ssm.group_count")), conv_kernel=int(g("ssm.conv_kernel")), use_conv_bias=conv_bias,
        use_bias=proj_bias, mlp_bias=any(n.endswith("ffn_up.bias") for n in by_name), layer_norm_epsilon=eps,
        intermediate_size=rows("ffn_up.weight") or 1,
    )
    if experts:
        d.update(n_routed_experts=experts, num_experts_per_tok=int(g("expert_used_count")),
                 moe_intermediate_size=int(g("expert_feed_forward_length")),
                 moe_shared_expert_intermediate_size=int(g("expert_shared_feed_forward_length")),
                 n_group=int(g("expert_group_count", 1) or 1), topk_group=int(g("expert_group_used_count", 1) or 1),
                 routed_scaling_factor=float(g("expert_weights_scale", 1.0)),
                 norm_topk_prob=bool(g("expert_weights_norm", True)))
    return d


@dataclass(frozen=True, slots=True)
class Entry:
    """Where an HF-named tensor comes from: its GGUF tensors (one, or an expert pair to stack) and
    the rewrite that undoes the converter's (on float32 values)."""

    tensors: tuple[Any, ...]
    undo: Callable[[np.ndarray], np.ndarray]
    rows: np.ndarray | None = None  # a 2-D weight's rows as a gather of the file's (stored blocks)
    cols: np.ndarray | None = None  # a 2-D weight's columns: the file's column j holds HF column cols[j]
    join: Callable[[list[np.ndarray]], np.ndarray] | None = None  # several tensors into one (else: rows concatenated)


def entries(f: GGUFSource, cfg: dict[str, Any]) -> dict[str, Entry]:
    """Every tensor the models read, by HF name (``Entry``: how to rebuild it from the file)."""
    if f.arch in MAMBA2_ARCHS:
        return _mamba2_entries(f, cfg)
    lfm2 = f.arch == "lfm2"
    layer_names, global_names = (_LFM2_NAMES, _LFM2_GLOBAL) if lfm2 else (_NAMES, _GLOBAL)
    nk, nv = (1, 1) if lfm2 else (cfg["linear_num_key_heads"], cfg["linear_num_value_heads"])
    dk, dv = (0, 0) if lfm2 else (cfg["linear_key_head_dim"], cfg["linear_value_head_dim"])
    tiled = f.arch in ("qwen35", "qwen35moe") and nk != nv  # _reorder_v_heads was applied

    def grouped_rows(n_heads_dim: int) -> np.ndarray:
        """Gather that turns the file's tiled value heads (``[r, nk, d]``) into HF's grouped ``[nk, r, d]``."""
        return np.arange(nv * n_heads_dim).reshape(nv // nk, nk, n_heads_dim).transpose(1, 0, 2).reshape(-1)

    by_name = {t.name: t for t in f.reader.tensors}
    out: dict[str, Entry] = {}
    for t in f.reader.tensors:
        if t.name in global_names:
            name, plus_one = global_names[t.name]
        elif t.name.startswith("blk."):
            _, idx, rest = t.name.split(".", 2)
            if int(idx) >= cfg["num_hidden_layers"] or rest not in layer_names:
                continue
            hf, plus_one = layer_names[rest]
            name = f"model.layers.{idx}.{hf}"
        else:
            continue
        rows: np.ndarray | None = None
        cols: np.ndarray | None = None
        if tiled and ".linear_attn." in name:
            if name.endswith("in_proj_qkv.weight"):
                qk = 2 * nk * dk
                rows = np.concatenate((np.arange(qk), qk + grouped_rows(dv)))
            elif name.endswith("in_proj_z.weight"):
                rows = grouped_rows(dv)
            elif name.endswith(("in_proj_a.weight", "in_proj_b.weight", ".A", ".dt_bias")):
                rows = grouped_rows(1)
            elif name.endswith("conv1d.weight"):
                qk = 2 * nk * dk
                rows = np.concatenate((np.arange(qk), qk + grouped_rows(dv)))
            elif name.endswith("out_proj.weight"):
                # the file's column j (tiled position) holds HF's grouped column cols[j]
                cols = np.arange(nv * dv).reshape(nk, nv // nk, dv).transpose(1, 0, 2).reshape(-1)
        if _in_block(t.name, "ssm_ba.weight"):  # Qwen3-Next: per key head [b (r heads), a (r heads)]: split by rows
            r = nv // nk
            per = np.arange(nk * 2 * r).reshape(nk, 2, r)
            for part, sel in (("b", per[:, 0].reshape(-1)), ("a", per[:, 1].reshape(-1))):
                out[name.replace("in_proj_ba", f"in_proj_{part}")] = Entry((t,), _undo(False, sel, None, name), sel)
            continue
        out[name] = Entry((t,), _undo(plus_one, rows, cols, name), rows, cols)
        if _in_block(t.name, "ffn_down_exps.weight"):
            gate = by_name[t.name.replace("ffn_down_exps", "ffn_gate_exps")]
            up = by_name[t.name.replace("ffn_down_exps", "ffn_up_exps")]
            # transformers' stacked [E, 2I, H]: the reader concatenates gate's rows and up's
            out[name.replace("down_proj", "gate_up_proj")] = Entry((gate, up), as_stored)
    return out


def _mamba2_entries(f: GGUFSource, cfg: dict[str, Any]) -> dict[str, Entry]:
    """``entries`` of Nemotron-H and Granite 4.0 hybrid GGUFs: renames, ``A`` / ``D`` / the gated norm
    flattened, Q/K rows un-permuted (llama.cpp's rotary pair order back to HF's halves; a gather),
    Granite's gate|up pairs concatenated back."""
    granite = f.arch == "granitehybrid"
    layer_names, global_names = (_GRANITE_NAMES, _GRANITE_GLOBAL) if granite else (_NEMOTRON_NAMES, _NEMOTRON_GLOBAL)
    by_name = {t.name: t for t in f.reader.tensors}
    out: dict[str, Entry] = {}
    for t in f.reader.tensors:
        if t.name in global_names:
            out[global_names[t.name]] = Entry((t,), as_stored)
            continue
        if not t.name.startswith("blk."):
            continue
        _, idx, rest = t.name.split(".", 2)
        if int(idx) >= cfg["num_hidden_layers"] or rest not in layer_names:
            continue
        name = f"model.layers.{idx}.{layer_names[rest]}"
        rows: np.ndarray | None = None
        if rest in ("attn_q.weight", "attn_k.weight"):
            n = int(t.shape[1])  # (output rows)
            head_dim = int(by_name[f"blk.{idx}.attn_q.weight"].shape[1]) // cfg["num_attention_heads"]
            h = n // head_dim
            rows = np.arange(n).reshape(h, n // h // 2, 2).transpose(0, 2, 1).reshape(-1)
        out[name] = Entry((t,), flattened if rest in _FLAT else _undo(False, rows, None, name), rows)
        if granite and rest in _GRANITE_PAIRS:
            hf, gate, up = _GRANITE_PAIRS[rest]
            out[f"model.layers.{idx}.{hf}"] = Entry((by_name[f"blk.{idx}.{gate}"], by_name[f"blk.{idx}.{up}"]), as_stored)
    return out


def flattened(w: np.ndarray) -> np.ndarray:
    """A GGUF tensor HF holds as one dimension."""
    return w.reshape(-1)


def _in_block(gguf_name: str, suffix: str) -> bool:
    """Whether ``gguf_name`` is a layer tensor (``blk.N.``) named ``suffix``."""
    return gguf_name.startswith("blk.") and gguf_name.endswith(suffix)


def as_stored(w: np.ndarray) -> np.ndarray:
    """A GGUF tensor HF holds as it is."""
    return w


def _undo(plus_one: bool, rows: np.ndarray | None, cols: np.ndarray | None,
          name: str) -> Callable[[np.ndarray], np.ndarray]:
    def undo(w: np.ndarray) -> np.ndarray:
        if plus_one:
            w = w - np.float32(1.0)
        if rows is not None:
            w = w[rows]
        if cols is not None:
            back = np.empty_like(cols)
            back[cols] = np.arange(cols.size)
            w = w[:, back]
        if name.endswith("shared_expert_gate.weight") and w.ndim == 1:
            w = w.reshape(1, -1)
        return w

    return undo
