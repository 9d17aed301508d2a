"""The architecture description every loader produces and every model consumes.

One frozen ``ModelConfig`` for every family: the Llama shape (every family has it), plus optional
parts a family adds — per-head q/k norms and sliding-window layers (Qwen3, Mistral, Gemma 3), a
mixture of experts (``MoEConfig``: Mixtral, Qwen2/3-MoE, DeepSeek), multi-head latent attention
(``MLAConfig``: DeepSeek-V2/V3) and Gemma's norms, embedding scale and soft-capping.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tripod.layers.mla import MLAConfig
from tripod.layers.moe import MoEConfig
from tripod.layers.parallel import SINGLE, ParallelGroup, head_split
from tripod.memory.kv_pool import PoolSpec

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
    "gemma3": ("Gemma3ForCausalLM",),
    "deepseek_v2": ("DeepseekV2ForCausalLM",),
    "deepseek_v3": ("DeepseekV3ForCausalLM",),
    "deepseek_v32": ("DeepseekV32ForCausalLM",),
    "gpt_oss": ("GptOssForCausalLM",),
}


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
        if self.mla is not None:
            return PoolSpec(layers, "latent", latent_dim=self.mla.pool_dim)
        _, _, k0, k1 = head_split(self.num_heads, self.num_kv_heads, tp)
        return PoolSpec(layers, "mha", num_kv_heads=k1 - k0, head_dim=self.head_dim)

    def mha_equivalent_spec(self) -> PoolSpec:
        """The pool the same model would need with its attention expanded (MLA: every head's K
        and V stored; otherwise the model's own)."""
        if self.mla is None:
            return self.pool_spec()
        m = self.mla
        # K is qk_head_dim wide, V v_head_dim: counted as two heads of their mean width.
        return PoolSpec(self.num_layers, "mha", num_kv_heads=self.num_heads,
                        head_dim=(m.qk_head_dim + m.v_head_dim) // 2)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from an HF ``config.json`` (old ``rope_scaling`` or new ``rope_parameters``)."""
        arch = architecture_of(d)
        mtype = str(d.get("model_type") or "")
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
        window, sliding = _sliding(d, layers)
        return cls(
            architecture=arch,
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
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
            qk_norm=mtype in ("qwen3", "qwen3_moe") or mtype.startswith("gemma3")
            or arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"),
            sliding_window=window,
            sliding_layers=sliding,
            rope_local_theta=float(local_theta) if local_theta is not None and gemma else None,
            norm_offset=gemma,
            embed_scale=gemma,
            sandwich_norms=gemma,
            query_pre_attn_scalar=float(d["query_pre_attn_scalar"]) if d.get("query_pre_attn_scalar") else None,
            attn_softcap=_opt_float(d.get("attn_logit_softcapping")),
            final_softcap=_opt_float(d.get("final_logit_softcapping")),
            moe=_moe(d, layers),
            mla=mla,
            num_nextn_predict_layers=int(d.get("num_nextn_predict_layers") or 0),
            attn_sinks=mtype == "gpt_oss" or arch == "GptOssForCausalLM",
        )


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
    if mtype.startswith("deepseek"):
        first_dense = int(d.get("first_k_dense_replace") or 0)
        freq = int(d.get("moe_layer_freq") or 1)
        dense = tuple(i for i in range(layers) if i < first_dense or i % freq)
        kinds = d.get("mlp_layer_types")
        if isinstance(kinds, list) and len(kinds) == layers:  # V3.2 names each layer's MLP
            dense = tuple(i for i, k in enumerate(kinds) if k != "sparse")
        v3 = mtype in ("deepseek_v3", "deepseek_v32") or d.get("topk_method") == "noaux_tc"
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
        rope_interleave=True if mtype == "deepseek_v2" else bool(d.get("rope_interleave", True)),
        index_n_heads=int(d.get("index_n_heads") or 0) if d.get("index_topk") else 0,
        index_head_dim=int(d.get("index_head_dim") or 0) if d.get("index_topk") else 0,
        index_topk=int(d.get("index_topk") or 0),
    )


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
