"""A hybrid model's layers as its HF config describes them: Qwen3.5, Qwen3.5-MoE and Qwen3-Next
(Gated DeltaNet layers beside gated attention layers; ``hybrid_config``), and the state-space hybrids
Nemotron-H, Granite 4.0 and LFM2 (Mamba2 / short-conv layers; ``state_space_fields``), and Kimi
Linear (KDA layers beside MLA; ``kimi_linear_dict``, ``kimi_hybrid``): read here, in one place, by ``ModelConfig.from_hf_dict`` (which attention layers the KV pool holds) and by the models
(which mixer each layer builds)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class HybridConfig:
    """A hybrid model's linear-attention layers (Gated DeltaNet, ``layers/gated_delta.py``) and its
    attention layers' extras (an output gate, partial rotary): Qwen3.5."""

    linear_layers: tuple[int, ...]  # the layers with a gated-delta-rule mixer (the others attend)
    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int
    conv_kernel: int
    rope_dim: int  # rotary channels of each attention head (the first ones; the rest pass through)
    hf: dict[str, Any] | None = field(default=None, compare=False, repr=False)  # state-space hybrids' HF config

    def is_linear(self, layer: int) -> bool:
        return layer in self.linear_layers


def hybrid_config(d: dict[str, Any], layers: int, head_dim: int) -> HybridConfig:
    """Qwen3.5's / Qwen3-Next's linear layers (``layer_types``, or transformers' default: every fourth layer attends)."""
    types = d.get("layer_types")
    if types is None:
        interval = int(d.get("full_attention_interval") or 4)
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
    bad = sorted({t for t in types if t not in ("linear_attention", "full_attention")})
    if len(types) != layers or bad:
        raise ValueError(f"layer_types must name each of the {layers} layers linear_attention or full_attention "
                         f"(got {types})")
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    partial = float(rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0)) or 1.0)
    rope_dim = int(head_dim * partial)
    if rope_dim % 2 or not 0 < rope_dim <= head_dim:
        raise ValueError(f"partial_rotary_factor {partial} gives {rope_dim} rotary channels of {head_dim}: "
                         "an even count up to head_dim is needed")
    return HybridConfig(
        linear_layers=tuple(i for i, t in enumerate(types) if t == "linear_attention"),
        k_heads=int(d["linear_num_key_heads"]), v_heads=int(d["linear_num_value_heads"]),
        k_dim=int(d["linear_key_head_dim"]), v_dim=int(d["linear_value_head_dim"]),
        conv_kernel=int(d.get("linear_conv_kernel_dim") or 4), rope_dim=rope_dim,
    )


ATTENTION = "full_attention"
NEMOTRON_CODES = {"M": "linear_attention", "*": ATTENTION, "-": "mlp", "E": "moe"}
GRANITE_LEGACY = {"mamba": "linear_attention", "attention": ATTENTION}  # older configs' layer names


def nemotron_kinds(d: Mapping[str, Any]) -> list[str]:
    """Each layer's kind from the HF config: ``layers_block_type`` or ``hybrid_override_pattern``."""
    kinds = d.get("layers_block_type") or d.get("layer_types")
    if kinds is None and d.get("hybrid_override_pattern"):
        bad = set(d["hybrid_override_pattern"]) - set(NEMOTRON_CODES)
        if bad:
            raise ValueError(f"hybrid_override_pattern has unknown layer codes {sorted(bad)} (known: M * - E)")
        kinds = [NEMOTRON_CODES[c] for c in d["hybrid_override_pattern"]]
    if not kinds:
        raise ValueError("a Nemotron-H config needs layers_block_type or hybrid_override_pattern")
    unknown = set(kinds) - set(NEMOTRON_CODES.values())
    if unknown:
        raise ValueError(f"layers_block_type has unknown kinds {sorted(unknown)} "
                         f"(known: {sorted(NEMOTRON_CODES.values())})")
    return list(kinds)


def granite_kinds(d: Mapping[str, Any]) -> list[str]:
    kinds = [GRANITE_LEGACY.get(k, k) for k in (d.get("layer_types") or d.get("layers_block_type") or [])]
    if len(kinds) != d["num_hidden_layers"]:
        raise ValueError(f"Granite hybrid: layer_types names {len(kinds)} layers, num_hidden_layers is "
                         f"{d['num_hidden_layers']}")
    bad = set(kinds) - set(GRANITE_LEGACY.values())
    if bad:
        raise ValueError(f"Granite hybrid: unknown layer types {sorted(bad)} (mamba / attention)")
    return kinds


def lfm2_kinds(d: Mapping[str, Any]) -> list[str]:
    n = d["num_hidden_layers"]
    kinds = d.get("layer_types")
    if kinds is None:
        full = d.get("full_attn_idxs")
        full = range(n) if full is None else full
        kinds = [ATTENTION if i in full else "conv" for i in range(n)]
    bad = set(kinds) - {"conv", ATTENTION}
    if bad or len(kinds) != n:
        raise ValueError(f"LFM2: layer_types must name conv or full_attention for each of {n} layers (got {kinds})")
    return list(kinds)


def layer_kinds_of(d: Mapping[str, Any], arch: str) -> list[str]:
    if arch == "NemotronHForCausalLM":
        return nemotron_kinds(d)
    if arch == "GraniteMoeHybridForCausalLM":
        return granite_kinds(d)
    return lfm2_kinds(d)


def granite_rope(d: Mapping[str, Any]) -> bool:
    pos = d.get("position_embedding_type")
    if pos not in (None, "nope", "rope"):
        raise ValueError(f"Granite hybrid: position_embedding_type {pos!r} is not supported (rope or none)")
    return pos == "rope"


STATE_SPACE_TYPES = {"nemotron_h": ("NemotronHForCausalLM",), "granitemoehybrid": ("GraniteMoeHybridForCausalLM",),
                     "lfm2": ("Lfm2ForCausalLM",)}  # HF model_type -> architecture
STATE_SPACE_ARCHS = frozenset(a for archs in STATE_SPACE_TYPES.values() for a in archs)


def _rope(d: Mapping[str, Any]) -> tuple[dict[str, Any] | None, float]:
    """(scaling beyond the default, base theta) from ``rope_parameters`` or the older keys."""
    rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    theta = float(rope.pop("rope_theta", None) or d.get("rope_theta") or 10000.0)
    kind = rope.get("rope_type", rope.get("type", "default"))
    return (rope if kind != "default" else None), theta


def state_space_fields(d: dict[str, Any], arch: str) -> dict[str, Any]:
    """``ModelConfig``'s fields for a Nemotron-H / Granite 4.0 / LFM2 config: the Llama-shaped ones
    the engine reads (vocabulary, the attention layers' heads for the KV pool, positions, EOS) and
    ``hybrid`` (a ``HybridConfig``) whose ``linear_layers`` are the
    layers that keep no K/V (Mamba2, short-conv, MLP and MoE layers) and ``hf`` the HF config, from
    which the model builds its layers."""
    kinds = layer_kinds_of(d, arch)
    hidden, heads = int(d["hidden_size"]), int(d["num_attention_heads"])
    head_dim = int(d.get("head_dim") or hidden // heads)
    scaling, theta = _rope(d)
    uses_rope = arch == "Lfm2ForCausalLM" or (arch == "GraniteMoeHybridForCausalLM" and granite_rope(d))
    eps = d.get("layer_norm_epsilon") or d.get("rms_norm_eps") or d.get("norm_eps") or 1e-5
    eos = d.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    no_kv = tuple(i for i, k in enumerate(kinds) if k != ATTENTION)
    return dict(
        architecture=arch,
        vocab_size=int(d["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(d.get("intermediate_size") or hidden),
        num_layers=len(kinds),
        num_heads=heads,
        num_kv_heads=int(d.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        rms_norm_eps=float(eps),
        rope_theta=theta,
        max_position_embeddings=int(d.get("max_position_embeddings") or 4096),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", arch == "Lfm2ForCausalLM")),
        rope_scaling=scaling if uses_rope else None,
        attention_bias=bool(d.get("attention_bias") or False),
        bos_token_id=d.get("bos_token_id"),
        eos_token_ids=tuple(int(e) for e in eos_ids),
        qk_norm=arch == "Lfm2ForCausalLM",
        hybrid=HybridConfig(linear_layers=no_kv, k_heads=0, v_heads=0, k_dim=0, v_dim=0, conv_kernel=0,
                          rope_dim=head_dim, hf=dict(d)),
    )


KIMI_ALIASES = {  # Kimi Linear's config.json keys -> the DeepSeek-V3 names the MLA / MoE readers use
    "num_experts_per_token": "num_experts_per_tok", "moe_renormalize": "norm_topk_prob",
    "num_expert_group": "n_group", "num_shared_experts": "n_shared_experts",
    "model_max_length": "max_position_embeddings", "num_local_experts": "num_experts",
}


def kimi_layer_types(d: Mapping[str, Any]) -> list[str]:
    """Each layer's mixer as transformers decides it: ``layer_types``, else ``linear_attn_config``'s
    1-indexed ``kda_layers`` / ``full_attn_layers`` (Moonshot's own configs), else every fourth
    layer from layer 4 on attends."""
    layers = int(d["num_hidden_layers"])
    types = d.get("layer_types")
    lac = d.get("linear_attn_config") or {}
    if types is None and "full_attn_layers" in lac and "kda_layers" in lac:
        named = {int(i) - 1: ATTENTION for i in lac["full_attn_layers"]} | {
            int(i) - 1: "linear_attention" for i in lac["kda_layers"]}
        types = [named.get(i, "") for i in range(layers)]
    if types is None:
        types = [ATTENTION if i and i % 4 == 0 else "linear_attention" for i in range(layers)]
    bad = sorted({t for t in types if t not in ("linear_attention", ATTENTION)})
    if len(types) != layers or bad:
        raise ValueError(f"Kimi Linear: layer_types must name each of the {layers} layers linear_attention or "
                         f"full_attention (got {types})")
    return list(types)


def kimi_linear_dict(d: Mapping[str, Any]) -> dict[str, Any]:
    """A Kimi Linear config in DeepSeek-V3's words (its attention is MLA, its MoE V3's: sigmoid
    scores, a correction bias, group-limited top-k), with ``layer_types`` and ``mlp_layer_types``
    filled in as transformers fills them (``first_k_dense_replace`` dense layers first, default 1)."""
    out = dict(d, model_type="kimi_linear")
    for theirs, ours in KIMI_ALIASES.items():
        if theirs in d and ours not in d:
            out[ours] = d[theirs]
    out["layer_types"] = kimi_layer_types(d)
    layers = int(d["num_hidden_layers"])
    if not isinstance(d.get("mlp_layer_types"), list):
        first = int(d.get("first_k_dense_replace", 1))
        out["mlp_layer_types"] = ["dense" if i < first else "sparse" for i in range(layers)]
    out.setdefault("topk_method", "noaux_tc")
    out.setdefault("scoring_func", "sigmoid")
    return out


def kimi_hybrid(d: Mapping[str, Any]) -> HybridConfig:
    """Kimi Linear's KDA layers (``layers/kda.py``): their heads, head size and short-conv kernel
    (``linear_attn_config`` or the flat keys transformers writes)."""
    lac = d.get("linear_attn_config") or {}
    heads = int(lac.get("num_heads") or d.get("linear_num_heads") or 32)
    dim = int(lac.get("head_dim") or d.get("linear_head_dim") or 128)
    kernel = int(lac.get("short_conv_kernel_size") or d.get("linear_conv_kernel_dim") or 4)
    types = kimi_layer_types(d)
    return HybridConfig(linear_layers=tuple(i for i, t in enumerate(types) if t != ATTENTION), k_heads=heads,
                        v_heads=heads, k_dim=dim, v_dim=dim, conv_kernel=kernel, rope_dim=0)


def minimax_hybrid(d: Mapping[str, Any], layers: int, heads: int, head_dim: int) -> HybridConfig:
    """MiniMax's lightning-attention layers (``layer_types``; transformers' default: odd layers),
    with the HF config in ``hf`` (the residual factors); a sliding window is refused (transformers
    would apply it to every attention layer; tripod does not read it for MiniMax yet)."""
    types = d.get("layer_types") or [ATTENTION if (i + 1) % 2 else "linear_attention" for i in range(layers)]
    bad = sorted({t for t in types if t not in ("linear_attention", ATTENTION)})
    if len(types) != layers or bad:
        raise ValueError(f"MiniMax: layer_types must name each of the {layers} layers linear_attention or "
                         f"full_attention (got {types})")
    if d.get("sliding_window"):
        raise ValueError("MiniMax with a sliding_window is not supported yet (set it to null for full attention)")
    return HybridConfig(linear_layers=tuple(i for i, t in enumerate(types) if t != ATTENTION), k_heads=heads,
                        v_heads=heads, k_dim=head_dim, v_dim=head_dim, conv_kernel=0, rope_dim=head_dim, hf=dict(d))
