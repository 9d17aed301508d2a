"""IBM Granite 4.0 hybrids (``GraniteMoeHybridForCausalLM``): each layer is
``x + m·mixer(rmsnorm(x))`` then ``x + m·ffn(rmsnorm(x))`` (``m`` the residual multiplier), where
the mixer is Mamba2 or attention (``layer_types``) and the FFN is a softmax-over-top-k MoE plus a
shared SwiGLU MLP (the shared MLP alone when there are no experts).

Granite's multipliers: embeddings times ``embedding_multiplier``, attention scaled by
``attention_multiplier`` (not ``1/sqrt(d)``), logits divided by ``logits_scaling``. Attention has
RoPE only when ``position_embedding_type`` is ``"rope"``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from tripod.layers.batch import Backend
from tripod.layers.mamba2 import Mamba2Config, Mamba2Mixer
from tripod.layers.mlp import GatedMLP, keep
from tripod.layers.moe import MoE, MoEConfig
from tripod.layers.norm import rms_norm
from tripod.layers.rotary import RotaryEmbedding
from tripod.layers.weights import WeightSource
from tripod.models.gqa import new_param
from tripod.models.hybrid import (
    AttnShape,
    CachedAttention,
    HybridCache,
    HybridForCausalLM,
    HybridLayer,
    mamba_config,
)

LEGACY = {"mamba": "linear_attention", "attention": "full_attention"}  # older configs' layer names


def granite_mamba(d: Mapping[str, Any]) -> Mamba2Config:
    h, heads = d["hidden_size"], d["mamba_n_heads"]
    inter = int(d.get("mamba_expand", 2) * h)
    head_dim = d.get("mamba_d_head", "auto")
    d = {**d, "mamba_d_head": inter // heads if head_dim == "auto" else head_dim}
    if d["mamba_d_head"] * heads != inter:
        raise ValueError(f"Granite hybrid: mamba_d_head x mamba_n_heads must equal mamba_expand x hidden_size ({inter})")
    return mamba_config(d, hidden_size="hidden_size", num_heads="mamba_n_heads", head_dim="mamba_d_head",
                        state_size="mamba_d_state", n_groups="mamba_n_groups", conv_kernel="mamba_d_conv",
                        eps="rms_norm_eps", conv_bias="mamba_conv_bias", proj_bias="mamba_proj_bias",
                        activation="hidden_act")


class GraniteHybridLayer(HybridLayer):
    """Mixer and FFN sublayers, each scaled by the residual multiplier before its residual add."""

    def __init__(self, index: int, kind: str, d: Mapping[str, Any], dtype: torch.dtype) -> None:
        h = d["hidden_size"]
        if kind == "linear_attention":
            mixer: Mamba2Mixer | CachedAttention = Mamba2Mixer(granite_mamba(d), dtype)
        else:
            heads = d["num_attention_heads"]
            shape = AttnShape(h, heads, d.get("num_key_value_heads") or heads, h // heads,
                              float(d.get("attention_multiplier", 1.0)), bool(d.get("attention_bias", False)))
            mixer = CachedAttention(shape, dtype)
        super().__init__(index, mixer)
        self.eps = float(d.get("rms_norm_eps", 1e-6))
        self.mult = float(d.get("residual_multiplier", 1.0))
        self.input_norm = new_param(h, dtype=dtype, fill=1.0)
        self.post_norm = new_param(h, dtype=dtype, fill=1.0)
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"Granite hybrid: hidden_act {act!r} is not supported (silu)")
        self.shared = GatedMLP(h, d["shared_intermediate_size"], act, dtype)
        self.moe: MoE | None = None
        if d.get("num_local_experts", 0):
            spec = MoEConfig(num_experts=d["num_local_experts"], top_k=d["num_experts_per_tok"],
                             intermediate_size=d["intermediate_size"], scoring="topk_softmax")
            self.moe = MoE(spec, h, act, dtype)

    def prepare(self, backend: Backend) -> None:
        super().prepare(backend)
        self.shared.prepare(backend, {})
        if self.moe is not None:
            self.moe.prepare(backend, {})

    def forward(self, x: torch.Tensor, backend: Backend, cache: HybridCache,
                rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        x = x + self.mix(rms_norm(x, self.input_norm, self.eps), backend, cache, rope) * self.mult
        h = rms_norm(x, self.post_norm, self.eps)
        out = self.shared(h, backend)
        if self.moe is not None:
            out = self.moe(h, backend) + out
        return x + out * self.mult


class GraniteMoeHybridForCausalLM(HybridForCausalLM):
    """Granite 4.0 hybrid: Mamba2 and attention layers, MoE + shared MLP, Granite's multipliers."""

    def __init__(self, d: Mapping[str, Any], dtype: torch.dtype = torch.float32) -> None:
        super().__init__(d["vocab_size"], d["hidden_size"], float(d.get("rms_norm_eps", 1e-6)),
                         bool(d.get("tie_word_embeddings", False)), dtype)
        kinds = [LEGACY.get(k, k) for k in (d.get("layer_types") or d.get("layers_block_type") or [])]
        if len(kinds) != d["num_hidden_layers"]:
            raise ValueError(f"Granite hybrid: layer_types names {len(kinds)} layers, num_hidden_layers is "
                             f"{d['num_hidden_layers']}")
        bad = set(kinds) - set(LEGACY.values())
        if bad:
            raise ValueError(f"Granite hybrid: unknown layer types {sorted(bad)} (mamba / attention)")
        self.layers = nn.ModuleList(GraniteHybridLayer(i, k, d, dtype) for i, k in enumerate(kinds))
        self.embed_scale = float(d.get("embedding_multiplier", 1.0))
        self.logits_div = float(d.get("logits_scaling", 1.0))
        pos = d.get("position_embedding_type")
        if pos == "rope":
            rope = dict(d.get("rope_parameters") or {})
            theta = float(rope.pop("rope_theta", d.get("rope_theta", 10000.0)))
            scaling = rope if rope.get("rope_type", "default") != "default" else None
            heads = d["num_attention_heads"]
            self.rotary = RotaryEmbedding(d["hidden_size"] // heads, theta, scaling, d["max_position_embeddings"],
                                          torch.device("cpu"))
        elif pos not in (None, "nope"):
            raise ValueError(f"Granite hybrid: position_embedding_type {pos!r} is not supported (rope or none)")

    def load_layer(self, layer: Any, src: WeightSource) -> None:
        p = f"model.layers.{layer.index}."
        layer.input_norm.data = src.get(p + "input_layernorm.weight")
        layer.post_norm.data = src.get(p + "post_attention_layernorm.weight")
        if isinstance(layer.mixer, Mamba2Mixer):
            layer.mixer.load(src, p + "mamba.")
        else:
            layer.mixer.load(src, p + "self_attn.")
        keep(layer.shared, "gate_up", src.part(p + "shared_mlp.input_linear.weight"))
        keep(layer.shared, "down", src.part(p + "shared_mlp.output_linear.weight"))
        if layer.moe is not None:
            m = p + "block_sparse_moe."
            layer.moe.router.data = src.get_f32(m + "router.weight")
            layer.moe.experts.load(src, m + "experts.", ("gate_proj", "up_proj", "down_proj"))
