"""The architecture description every loader produces and every model consumes: one frozen
``ModelConfig`` for every family, the Llama shape plus optional parts a family adds — per-head q/k
norms and sliding-window layers (Qwen3, Mistral, Gemma 3), a mixture of experts (``MoEConfig``),
multi-head latent attention (``MLAConfig``: DeepSeek-V2/V3), Gemma's norms, embedding scale and
soft-capping, and a hybrid's recurrent layers (``HybridConfig``: Qwen3.5, the state-space hybrids)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tripod.layers.compressed import CompressedAttnConfig
from tripod.layers.mla import MLAConfig
from tripod.layers.moe import MoEConfig
from tripod.layers.parallel import SINGLE, ParallelGroup, head_split
from tripod.memory.kv_pool import PoolSpec
from tripod.models.hybrid_config import (
    STATE_SPACE_ARCHS,
    STATE_SPACE_TYPES,
    HybridConfig,
    hybrid_config,
    kimi_hybrid,
    kimi_linear_dict,
    minimax_hybrid,
    state_space_fields,
)
from tripod.models.vision.spec import VLM_ARCHITECTURES, VisionSpec, vlm_family

ACTIVATIONS = ("silu", "gelu_tanh")

# HF ``model_type`` -> the architectures (``architectures[0]``) a config of that type may name, the
# first being the one transformers picks for a causal LM when ``architectures`` is absent.
MODEL_TYPES: dict[str, tuple[str, ...]] = {
    "llama": ("LlamaForCausalLM",),
    "mistral": ("MistralForCausalLM",),
    "mixtral": ("MixtralForCausalLM",),
    "qwen2": ("Qwen2ForCausalLM",),
    "qwen2_moe": ("Qwen2MoeForCausalLM",),
    "qwen3": ("Qwen3ForCausalLM",),
    "qwen3_moe": ("Qwen3MoeForCausalLM",),
    "gemma3_text": ("Gemma3ForCausalLM",),
    "gemma3": ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"),
    "deepseek_v2": ("DeepseekV2ForCausalLM",),
    "deepseek_v3": ("DeepseekV3ForCausalLM",),
    "deepseek_v32": ("DeepseekV32ForCausalLM",),
    "gpt_oss": ("GptOssForCausalLM",),
    "deepseek_v4": ("DeepseekV4ForCausalLM",),
    "llava": ("LlavaForConditionalGeneration",),
    "qwen2_5_vl": ("Qwen2_5_VLForConditionalGeneration",),
    "qwen3_5_text": ("Qwen3_5ForCausalLM",),
    "qwen3_5": ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"),
    "qwen3_5_moe_text": ("Qwen3_5MoeForCausalLM",),
    "qwen3_5_moe": ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"),
    "qwen3_next": ("Qwen3NextForCausalLM",),
    "kimi_linear": ("KimiLinearForCausalLM",),  # KDA layers beside MLA layers (models/kimi_linear.py)
    "minimax": ("MiniMaxForCausalLM",),  # lightning attention beside GQA layers (models/minimax.py)
    **STATE_SPACE_TYPES,  # Nemotron-H, Granite 4.0, LFM2: Mamba2 / short-conv layers (models/hybrid.py)
}
# Decoders with Gated DeltaNet layers beside gated attention (``HybridConfig``).
HYBRID_TYPES = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
# Hybrid linear-attention families whose multimodal folders tripod runs the text part of: the
# outer ``model_type`` -> the decoder's (its ``text_config`` is the decoder's config).
HYBRID_TEXT = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
# A vision-language family's decoder, as an HF text config names it (when its own type is not one).
VLM_DECODERS = {"qwen2_5_vl": ("qwen2", "Qwen2ForCausalLM"), "gemma3": ("gemma3_text", "Gemma3ForCausalLM")}


def architecture_of(d: dict[str, Any]) -> str:
    """The architecture an HF ``config.json`` describes, as transformers decides it: ``architectures``
    when given, else from ``model_type``. A config whose two say different things is refused (it
    would load one family's weights as another's), naming both."""
    archs = d.get("architectures")
    mtype = d.get("model_type")
    known = MODEL_TYPES.get(str(mtype)) if mtype else None
    if archs:
        arch = str(archs[0])
        owner = next((t for t, names in MODEL_TYPES.items() if arch in names), None)
        if known is not None and owner is not None and arch not in known:
            raise ValueError(f"config.json says architectures {arch!r} but model_type {mtype!r} "
                             f"(whose architecture is {known[0]!r}); make the two agree")
        return arch
    if known is not None:
        return known[0]
    if mtype:
        raise ValueError(f"config.json has no architectures and its model_type {mtype!r} is not one tripod "
                         f"supports; supported model types: {', '.join(sorted(MODEL_TYPES))}")
    return "LlamaForCausalLM"  # neither said: the decoder every family builds on


@dataclass(frozen=True, slots=True)
class V4Config:
    """DeepSeek-V4's parts beyond the Llama shape: its attention (``layers/compressed.py``), the
    ``hc_mult`` residual streams mixed by hyper-connections, and the hash-routed MoE layers."""

    attn: CompressedAttnConfig
    hc_mult: int
    hc_iters: int  # Sinkhorn-Knopp iterations
    hc_eps: float
    hash_layers: tuple[int, ...]  # layers whose experts are chosen by token id (``tid2eid``)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """A decoder-only transformer's shape, independent of where the weights came from."""

    architecture: str  # HF architecture name, e.g. "LlamaForCausalLM"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_scaling: dict[str, Any] | None = None
    attention_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    hidden_act: str = "silu"
    qk_norm: bool = False  # per-head RMSNorm of Q and K before RoPE (Qwen3, Gemma 3)
    # Sliding-window attention: a query at position p sees keys p - window + 1 .. p, on the
    # layers ``sliding_layers`` names (all layers when it is None and ``sliding_window`` is set).
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] | None = None
    rope_local_theta: float | None = None  # Gemma 3: the sliding layers' own RoPE base
    # Gemma: RMSNorm weights applied as (1 + w), embeddings scaled by sqrt(hidden), norms around
    # both sublayers' outputs too, its own attention scale, tanh soft-capping of the logits.
    norm_offset: bool = False
    embed_scale: bool = False
    sandwich_norms: bool = False
    query_pre_attn_scalar: float | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None
    moe: MoEConfig | None = None
    mla: MLAConfig | None = None
    num_nextn_predict_layers: int = 0  # DeepSeek-V3's multi-token-prediction modules
    attn_sinks: bool = False  # gpt-oss: a learned per-head logit in every softmax (AttnSpec.sinks)
    v4: V4Config | None = None  # DeepSeek-V4: compressed attention, hyper-connections, hash routing
    vision: VisionSpec | None = None  # a vision-language model: how images become decoder inputs
    hybrid: HybridConfig | None = None  # linear-attention layers beside the attention ones (Qwen3.5)

    def is_sliding(self, layer: int) -> bool:
        if self.sliding_window is None:
            return False
        return self.sliding_layers is None or layer in self.sliding_layers

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and layer not in self.moe.dense_layers

    @property
    def attn_scale(self) -> float:
        if self.mla is not None:
            return self.mla.qk_head_dim**-0.5 * _mla_mscale(self.rope_scaling)
        if self.query_pre_attn_scalar is not None:
            return float(self.query_pre_attn_scalar) ** -0.5
        return self.head_dim**-0.5

    def pool_spec(self, tp: ParallelGroup = SINGLE, num_layers: int | None = None) -> PoolSpec:
        """What one token costs in the KV pool: K and V per KV head (this rank's, under tensor
        parallelism), or MLA's latent; over ``num_layers`` layers (a pipeline stage's; default all)."""
        layers = self.num_layers if num_layers is None else num_layers
        if self.hybrid is not None:  # only the attention layers keep K/V per token
            layers = self.num_layers - len(self.hybrid.linear_layers)
        if self.mla is not None:
            return PoolSpec(layers, "latent", latent_dim=self.mla.pool_dim)
        if self.v4 is not None:
            return PoolSpec(layers, "latent", latent_dim=self.v4.attn.row_dim)
        _, _, k0, k1 = head_split(self.num_heads, self.num_kv_heads, tp)
        return PoolSpec(layers, "mha", num_kv_heads=k1 - k0, head_dim=self.head_dim)

    def mha_equivalent_spec(self) -> PoolSpec:
        """The pool the same model would need with its attention expanded (MLA: every head's K
        and V stored; otherwise the model's own)."""
        if self.v4 is not None:  # one K=V head per layer shared by all: expanded, K and V per head
            return PoolSpec(self.num_layers, "mha", num_kv_heads=self.num_heads, head_dim=self.head_dim)
        if self.mla is None:
            return self.pool_spec()
        m = self.mla
        # K is qk_head_dim wide, V v_head_dim: counted as two heads of their mean width.
        return PoolSpec(self.num_layers, "mha", num_kv_heads=self.num_heads,
                        head_dim=(m.qk_head_dim + m.v_head_dim) // 2)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from an HF ``config.json`` (old ``rope_scaling`` or new ``rope_parameters``). A
        vision-language checkpoint's is its ``text_config`` with the ``VisionSpec`` beside it."""
        if str(d.get("model_type")) in HYBRID_TEXT and isinstance(d.get("text_config"), dict):
            return _hybrid_text_part(d)
        family = vlm_family(d)
        if family is not None and isinstance(d.get("text_config"), dict):
            return _vision_language(d, family)
        arch = architecture_of(d)
        if arch in STATE_SPACE_ARCHS:  # (its layers from models/hybrid_config.py)
            return cls(**state_space_fields(d, arch))
        mtype = str(d.get("model_type") or "")
        kimi = mtype == "kimi_linear" or arch == "KimiLinearForCausalLM"
        if kimi:  # (DeepSeek-V3's MLA and MoE under other names)
            d, mtype = kimi_linear_dict(d), "kimi_linear"
        heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        rope, theta, local_theta = _rope(d)
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        gemma = mtype.startswith("gemma") or arch.startswith("Gemma")
        act = str(d.get("hidden_activation") or d.get("hidden_act") or "silu")
        if act in ("gelu_pytorch_tanh", "gelu_tanh"):
            act = "gelu_tanh"
        if act not in ACTIVATIONS:
            raise ValueError(f"activation {act!r} is not supported; supported: silu, gelu_pytorch_tanh")
        mla = _mla(d)
        layers = int(d["num_hidden_layers"])
        v4 = _v4(d, layers) if mtype == "deepseek_v4" or arch == "DeepseekV4ForCausalLM" else None
        window, sliding = _sliding(d, layers) if v4 is None else (None, None)  # (V4's window: its attention's)
        hybrid = hybrid_config(d, layers, int(d.get("head_dim") or hidden // heads)) if mtype in HYBRID_TYPES else None
        if kimi:
            hybrid = kimi_hybrid(d)
        if mtype == "minimax" or arch == "MiniMaxForCausalLM":
            hybrid = minimax_hybrid(d, layers, heads, int(d.get("head_dim") or hidden // heads))
            window, sliding = None, None
        if hybrid is not None:
            window, sliding = None, None
        return cls(
            architecture=arch,
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d.get("intermediate_size") or d["moe_intermediate_size"]),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads) if mla is None else mla.qk_head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta if theta is not None else 10000.0),
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", gemma)),
            rope_scaling=dict(rope) if rope else None,
            attention_bias=bool(d.get("attention_bias", False)),
            mlp_bias=bool(d.get("mlp_bias", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=tuple(int(e) for e in eos_ids),
            hidden_act=act,
            qk_norm=mtype in ("qwen3", "qwen3_moe", *HYBRID_TYPES) or mtype.startswith("gemma3")
            or arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"),
            sliding_window=window,
            sliding_layers=sliding,
            rope_local_theta=float(local_theta) if local_theta is not None and gemma else None,
            norm_offset=gemma or mtype in HYBRID_TYPES,  # (Qwen3.5's norms scale by 1 + w too)
            embed_scale=gemma,
            sandwich_norms=gemma,
            query_pre_attn_scalar=float(d["query_pre_attn_scalar"]) if d.get("query_pre_attn_scalar") else None,
            attn_softcap=_opt_float(d.get("attn_logit_softcapping")),
            final_softcap=_opt_float(d.get("final_logit_softcapping")),
            moe=_moe(d, layers),
            mla=mla,
            num_nextn_predict_layers=int(d.get("num_nextn_predict_layers") or 0),
            attn_sinks=mtype == "gpt_oss" or arch == "GptOssForCausalLM",
            v4=v4,
            hybrid=hybrid,
        )


def _vision_language(d: dict[str, Any], family: str) -> ModelConfig:
    """A vision-language config: its decoder from ``text_config`` (typed as the decoder family tripod
    runs; Qwen2.5-VL's M-RoPE sections go to the ``VisionSpec``, its rotary otherwise the default)."""
    import dataclasses

    text = dict(d["text_config"])
    mtype = str(text.get("model_type") or "llama")
    if family in VLM_DECODERS:
        mtype, arch = VLM_DECODERS[family]
    else:
        decoders = sorted(set(MODEL_TYPES) - set(VLM_ARCHITECTURES.values()))
        if mtype not in decoders:  # (never run another family's decoder as a Llama: silently wrong)
            raise ValueError(f"the {family} checkpoint's text_config has model_type {mtype!r}, a decoder tripod "
                             f"does not run; supported decoders: {', '.join(decoders)}")
        arch = architecture_of(text)
    text.update(model_type=mtype, architectures=[arch])
    for key in ("rope_parameters", "rope_scaling"):
        rope = text.get(key) or (d.get(key) if family == "qwen2_5_vl" else None)
        if isinstance(rope, dict) and (rope.get("rope_type") or rope.get("type")) == "mrope":
            text[key] = {k: v for k, v in rope.items() if k not in ("type", "rope_type", "mrope_section")}
    if "tie_word_embeddings" in d:
        text["tie_word_embeddings"] = d["tie_word_embeddings"]
    cfg = ModelConfig.from_hf_dict(text)
    vlm_arch = str((d.get("architectures") or [MODEL_TYPES[str(d.get("model_type"))][-1]])[0])
    # NOTE: transformers' Gemma3ForConditionalGeneration soft-caps no logits (its causal LM does);
    # Gemma 3 checkpoints set final_logit_softcapping to null anyway.
    final = None if family == "gemma3" else cfg.final_softcap
    return dataclasses.replace(cfg, architecture=vlm_arch, vision=VisionSpec.from_hf(d, family), final_softcap=final)


def _hybrid_text_part(d: dict[str, Any]) -> ModelConfig:
    """A hybrid family's multimodal folder: its decoder, from ``text_config`` (the vision tower is
    not run; the architecture stays the folder's, so its weight names are read)."""
    import dataclasses

    text = dict(d["text_config"])
    text.update(model_type=HYBRID_TEXT[str(d["model_type"])], architectures=None)
    if "tie_word_embeddings" in d:
        text["tie_word_embeddings"] = d["tie_word_embeddings"]
    cfg = ModelConfig.from_hf_dict(text)
    arch = str((d.get("architectures") or [MODEL_TYPES[str(d["model_type"])][-1]])[0])
    return dataclasses.replace(cfg, architecture=arch)


def _rope(d: dict[str, Any]) -> tuple[dict[str, Any] | None, Any, Any]:
    """(scaling beyond the default, base theta, the sliding layers' theta) from old ``rope_scaling``
    or new ``rope_parameters`` (per layer type in Gemma 3)."""
    rope = d.get("rope_parameters") or d.get("rope_scaling") or None
    theta = d.get("rope_theta")
    local_theta = d.get("rope_local_base_freq")
    if isinstance(rope, dict) and "full_attention" in rope:  # per layer type (Gemma 3)
        local = rope.get("sliding_attention") or {}
        local_theta = local.get("rope_theta", local_theta)
        rope = rope["full_attention"]
    if theta is None and isinstance(rope, dict):
        theta = rope.get("rope_theta")
    if isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) in (None, "default"):
        rope = None
    return rope, theta, local_theta


def _opt_float(v: Any) -> float | None:
    return None if v is None else float(v)


def _sliding(d: dict[str, Any], layers: int) -> tuple[int | None, tuple[int, ...] | None]:
    """The sliding window and the layers it applies to, as HF's config says."""
    window = d.get("sliding_window")
    if not window:
        return None, None
    mtype = str(d.get("model_type") or "")
    types = d.get("layer_types")
    if isinstance(types, list) and len(types) == layers:
        sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
        return (int(window), sliding) if sliding else (None, None)
    if mtype.startswith("qwen"):
        # Qwen2/3 declare sliding_window but apply it only with use_sliding_window.
        if not d.get("use_sliding_window"):
            return None, None
        first_full = int(d.get("max_window_layers", layers))
        return int(window), tuple(range(first_full, layers))
    if mtype.startswith("gemma3"):
        pattern = int(d.get("sliding_window_pattern") or d.get("_sliding_window_pattern") or 6)
        return int(window), tuple(i for i in range(layers) if (i + 1) % pattern)
    return int(window), None  # Mistral / Mixtral: every layer


def _moe(d: dict[str, Any], layers: int) -> MoEConfig | None:
    n = d.get("num_experts") or d.get("num_local_experts") or d.get("n_routed_experts")
    if not n:
        return None
    mtype = str(d.get("model_type") or "")
    top_k = int(d.get("num_experts_per_tok") or 2)
    inter = int(d.get("moe_intermediate_size") or d["intermediate_size"])
    if mtype == "deepseek_v4":  # every layer MoE; sqrt(softplus) scores; the clamped SwiGLU everywhere
        return MoEConfig(
            num_experts=int(n), top_k=top_k, intermediate_size=inter, scoring=str(d.get("scoring_func") or "sqrtsoftplus"),
            norm_topk_prob=True, routed_scaling_factor=float(d.get("routed_scaling_factor") or 1.0),
            correction_bias=True, shared_intermediate_size=inter * int(d.get("n_shared_experts") or 0),
            swiglu_limit=float(d.get("swiglu_limit") or 10.0), swiglu_style="clamp",
        )
    if mtype.startswith("deepseek") or mtype == "kimi_linear":
        first_dense = int(d.get("first_k_dense_replace") or 0)
        freq = int(d.get("moe_layer_freq") or 1)
        dense = tuple(i for i in range(layers) if i < first_dense or i % freq)
        kinds = d.get("mlp_layer_types")
        if isinstance(kinds, list) and len(kinds) == layers:  # V3.2 names each layer's MLP
            dense = tuple(i for i, k in enumerate(kinds) if k != "sparse")
        v3 = mtype in ("deepseek_v3", "deepseek_v32", "kimi_linear") or d.get("topk_method") == "noaux_tc"
        method = d.get("topk_method") or ("noaux_tc" if v3 else "greedy")
        topk_method = {"noaux_tc": "group_top2", "group_limited_greedy": "group_max", "greedy": "greedy"}.get(method)
        if topk_method is None:
            raise ValueError(f"DeepSeek topk_method {method!r} is not supported")
        scoring = str(d.get("scoring_func") or ("sigmoid" if v3 else "softmax"))
        return MoEConfig(
            num_experts=int(n), top_k=top_k, intermediate_size=inter, scoring=scoring,
            norm_topk_prob=bool(d.get("norm_topk_prob", v3)),
            routed_scaling_factor=float(d.get("routed_scaling_factor") or 1.0),
            topk_method=topk_method, n_group=int(d.get("n_group") or 1), topk_group=int(d.get("topk_group") or 1),
            correction_bias=v3, shared_intermediate_size=inter * int(d.get("n_shared_experts") or 0),
            dense_layers=dense,
        )
    if mtype == "gpt_oss":  # softmax over the top-k router logits (+ its bias); biased clamped-SwiGLU experts
        return MoEConfig(num_experts=int(n), top_k=top_k, intermediate_size=inter, scoring="topk_softmax",
                         router_bias=True, expert_bias=True, swiglu_limit=float(d.get("swiglu_limit") or 7.0),
                         swiglu_alpha=float(d.get("swiglu_alpha") or 1.702))
    only = tuple(int(i) for i in d.get("mlp_only_layers") or ())
    step = int(d.get("decoder_sparse_step") or 1)
    dense = tuple(i for i in range(layers) if i in only or (i + 1) % step)
    shared = int(d.get("shared_expert_intermediate_size") or 0)
    return MoEConfig(
        num_experts=int(n), top_k=top_k, intermediate_size=inter,
        # Mixtral always renormalizes; Qwen's MoEs say so in norm_topk_prob.
        norm_topk_prob=bool(d.get("norm_topk_prob", True)) if mtype != "mixtral" else True,
        shared_intermediate_size=shared, shared_gate=shared > 0, dense_layers=dense,
    )


def _mla(d: dict[str, Any]) -> MLAConfig | None:
    if not d.get("kv_lora_rank"):
        return None
    mtype = str(d.get("model_type") or "")
    return MLAConfig(
        kv_lora_rank=int(d["kv_lora_rank"]),
        qk_nope_head_dim=int(d["qk_nope_head_dim"]),
        qk_rope_head_dim=int(d["qk_rope_head_dim"]),
        v_head_dim=int(d["v_head_dim"]),
        q_lora_rank=int(d["q_lora_rank"]) if d.get("q_lora_rank") else None,
        # V2 rotates (even, odd) pairs as complex numbers; V3 says so in rope_interleave.
        rope_interleave=True if mtype == "deepseek_v2" else (mtype != "kimi_linear" and bool(d.get("rope_interleave", True))),
        nope=mtype == "kimi_linear",  # Kimi Linear's MLA has no positional encoding (its KDA layers order tokens)
        index_n_heads=int(d.get("index_n_heads") or 0) if d.get("index_topk") else 0,
        index_head_dim=int(d.get("index_head_dim") or 0) if d.get("index_topk") else 0,
        index_topk=int(d.get("index_topk") or 0),
    )


_V4_KINDS = {"sliding_attention": "sliding", "compressed_sparse_attention": "csa",
             "heavily_compressed_attention": "hca"}
_V4_RATIOS = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}


def _v4(d: dict[str, Any], layers: int) -> V4Config:
    """DeepSeek-V4's config, as transformers reads it (``layer_types`` or the older
    ``compress_ratios``; ``rope_parameters`` keyed ``main`` / ``compress``)."""
    types = d.get("layer_types")
    if types is None and d.get("compress_ratios") is not None:
        types = [_V4_RATIOS[int(r)] for r in d["compress_ratios"]]
    if types is None:  # transformers' default: two HCA layers, then CSA / HCA alternating
        types = ["heavily_compressed_attention"] * min(layers, 2) + [
            "compressed_sparse_attention" if i % 2 else "heavily_compressed_attention" for i in range(max(layers - 2, 0))]
    bad = [t for t in types if t not in _V4_KINDS]
    if len(types) < layers or bad:
        raise ValueError(f"DeepSeek-V4 layer_types must name each of the {layers} layers as one of "
                         f"{', '.join(_V4_KINDS)} (got {types})")
    rates = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128, **(d.get("compress_rates") or {})}
    head_dim = int(d["head_dim"])
    partial = d.get("partial_rotary_factor")
    rope_dim = int(d["qk_rope_head_dim"]) if d.get("qk_rope_head_dim") else int(head_dim * float(partial or 64 / 512))
    rp = d.get("rope_parameters") or {}
    main = rp.get("main") if isinstance(rp.get("main"), dict) else {}
    comp = rp.get("compress") if isinstance(rp.get("compress"), dict) else dict(rp)
    scaling = {k: v for k, v in comp.items() if k not in ("rope_theta", "partial_rotary_factor")}
    if scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = {}
    elif scaling.get("rope_type") == "yarn":
        scaling.setdefault("attention_factor", 1.0)  # V4 does not scale cos/sin by YaRN's mscale
    kinds = d.get("mlp_layer_types")
    if kinds is None:
        n_hash = int(d.get("num_hash_layers", 3))
        kinds = ["hash_moe"] * min(layers, n_hash) + ["moe"] * max(0, layers - n_hash)
    attn = CompressedAttnConfig(
        head_dim=head_dim, rope_dim=rope_dim, q_lora_rank=int(d["q_lora_rank"]), o_groups=int(d["o_groups"]),
        o_lora_rank=int(d["o_lora_rank"]), window=int(d.get("sliding_window") or 128),
        kinds=tuple(_V4_KINDS[t] for t in types[:layers]),
        csa_rate=int(rates["compressed_sparse_attention"]), hca_rate=int(rates["heavily_compressed_attention"]),
        index_heads=int(d.get("index_n_heads") or 64), index_dim=int(d.get("index_head_dim") or 128),
        index_topk=int(d.get("index_topk") or 512),
        main_theta=float(main.get("rope_theta") or d.get("rope_theta") or 10000.0),
        compress_theta=float(comp.get("rope_theta") or d.get("compress_rope_theta") or 160000.0),
        compress_scaling=scaling or None,
    )
    return V4Config(attn=attn, hc_mult=int(d.get("hc_mult") or 4), hc_iters=int(d.get("hc_sinkhorn_iters") or 20),
                    hc_eps=float(d.get("hc_eps") or 1e-6),
                    hash_layers=tuple(i for i, k in enumerate(kinds[:layers]) if k == "hash_moe"))


def _mla_mscale(rope: dict[str, Any] | None) -> float:
    """DeepSeek's YaRN: the softmax scale grows by mscale(factor, mscale_all_dim) squared."""
    import math

    if not rope or rope.get("rope_type", rope.get("type", "default")) == "default":
        return 1.0
    all_dim = rope.get("mscale_all_dim") or 0
    factor = float(rope.get("factor") or 1.0)
    if not all_dim or factor <= 1:
        return 1.0
    m = 0.1 * float(all_dim) * math.log(factor) + 1.0
    return m * m
