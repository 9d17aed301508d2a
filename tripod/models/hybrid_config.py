"""A hybrid model's linear-attention layers as its HF config describes them (Qwen3.5, Qwen3.5-MoE,
Qwen3-Next: Gated DeltaNet layers beside gated attention layers)."""

from __future__ import annotations

from dataclasses import dataclass
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
