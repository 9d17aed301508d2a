"""Liquid AI's LFM2 (``Lfm2ForCausalLM``): gated short-convolution layers (``layers/short_conv.py``)
beside attention layers (per-head q/k RMSNorm, then RoPE), each followed by a SwiGLU MLP:
``x + mixer(norm(x))``, ``x + mlp(norm(x))``. The final norm is named ``embedding_norm``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from tripod.layers.batch import Backend
from tripod.layers.mlp import GatedMLP, keep
from tripod.layers.norm import rms_norm
from tripod.layers.rotary import RotaryEmbedding
from tripod.layers.short_conv import ShortConv
from tripod.layers.weights import WeightSource
from tripod.models.gqa import new_param
from tripod.models.hybrid import (
    AttnShape,
    CachedAttention,
    HybridCache,
    HybridForCausalLM,
    HybridLayer,
)


def ffn_size(d: Mapping[str, Any]) -> int:
    """The MLP's width as LFM2 derives it (``block_auto_adjust_ff_dim``: 2/3, times the multiplier,
    rounded up to ``block_multiple_of``)."""
    inter = int(d["intermediate_size"])
    if d.get("block_auto_adjust_ff_dim", True):
        inter = int(2 * inter / 3)
        mult = d.get("block_ffn_dim_multiplier", 1.0)
        if mult is not None:
            inter = int(mult * inter)
            step = int(d.get("block_multiple_of", 256))
            inter = step * ((inter + step - 1) // step)
    return inter


def lfm2_kinds(d: Mapping[str, Any]) -> list[str]:
    n = d["num_hidden_layers"]
    kinds = d.get("layer_types")
    if kinds is None:
        full = d.get("full_attn_idxs")
        full = range(n) if full is None else full
        kinds = ["full_attention" if i in full else "conv" for i in range(n)]
    bad = set(kinds) - {"conv", "full_attention"}
    if bad or len(kinds) != n:
        raise ValueError(f"LFM2: layer_types must name conv or full_attention for each of {n} layers (got {kinds})")
    return list(kinds)


class Lfm2Layer(HybridLayer):
    """Operator (short conv or attention) and SwiGLU MLP, each pre-normed with a residual."""

    def __init__(self, index: int, kind: str, d: Mapping[str, Any], dtype: torch.dtype) -> None:
        h, heads = d["hidden_size"], d["num_attention_heads"]
        self.eps = float(d.get("norm_eps", 1e-5))
        if kind == "conv":
            mixer: ShortConv | CachedAttention = ShortConv(h, d["conv_L_cache"], bool(d.get("conv_bias", False)), dtype)
        else:
            hd = h // heads
            shape = AttnShape(h, heads, d.get("num_key_value_heads") or heads, hd, hd**-0.5, qk_norm_eps=self.eps,
                              o_name="out_proj")
            mixer = CachedAttention(shape, dtype)
        super().__init__(index, mixer)
        self.op_norm = new_param(h, dtype=dtype, fill=1.0)
        self.ffn_norm = new_param(h, dtype=dtype, fill=1.0)
        self.mlp = GatedMLP(h, ffn_size(d), "silu", dtype)

    def prepare(self, backend: Backend) -> None:
        super().prepare(backend)
        self.mlp.prepare(backend, {})

    def forward(self, x: torch.Tensor, backend: Backend, cache: HybridCache,
                rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        x = x + self.mix(rms_norm(x, self.op_norm, self.eps), backend, cache, rope)
        return self.mlp(rms_norm(x, self.ffn_norm, self.eps), backend, residual=x)


class Lfm2ForCausalLM(HybridForCausalLM):
    """LFM2: short-conv and attention layers, SwiGLU MLPs, tied embeddings by default."""

    norm_name = "model.embedding_norm.weight"

    def __init__(self, d: Mapping[str, Any], dtype: torch.dtype = torch.float32) -> None:
        super().__init__(d["vocab_size"], d["hidden_size"], float(d.get("norm_eps", 1e-5)),
                         bool(d.get("tie_word_embeddings", True)), dtype)
        self.layers = nn.ModuleList(Lfm2Layer(i, k, d, dtype) for i, k in enumerate(lfm2_kinds(d)))
        rope = dict(d.get("rope_parameters") or {})
        theta = float(rope.pop("rope_theta", d.get("rope_theta", 1000000.0)))
        scaling = rope if rope.get("rope_type", "default") != "default" else None
        self.rotary = RotaryEmbedding(d["hidden_size"] // d["num_attention_heads"], theta, scaling,
                                      d["max_position_embeddings"], torch.device("cpu"))

    def load_layer(self, layer: Any, src: WeightSource) -> None:
        p = f"model.layers.{layer.index}."
        layer.op_norm.data = src.get(p + "operator_norm.weight")
        layer.ffn_norm.data = src.get(p + "ffn_norm.weight")
        if isinstance(layer.mixer, ShortConv):
            layer.mixer.load(src, p + "conv.")
        else:
            layer.mixer.load(src, p + "self_attn.", ("q_layernorm", "k_layernorm"))
        f = p + "feed_forward."
        keep(layer.mlp, "gate_up", src.cat([f + "w1.weight", f + "w3.weight"]))
        keep(layer.mlp, "down", src.part(f + "w2.weight"))
