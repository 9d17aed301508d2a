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
from tripod.layers.short_conv import ShortConv
from tripod.layers.weights import WeightSource
from tripod.models.gqa import GQAttention, new_param
from tripod.models.hybrid import HybridLayer, StateSpaceHybrid, load_attention, mlp_sites
from tripod.models.hybrid_config import lfm2_kinds
from tripod.models.llama import StepContext


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


class Lfm2Layer(HybridLayer):
    """Operator (short conv or attention) and SwiGLU MLP, each pre-normed with a residual."""

    def __init__(self, index: int, kind: str, model: Lfm2ForCausalLM) -> None:
        d, dtype = model.hf, model.dtype
        h = d["hidden_size"]
        self.eps = float(d.get("norm_eps", 1e-5))
        if kind == "conv":
            mixer: ShortConv | GQAttention = ShortConv(h, d["conv_L_cache"], bool(d.get("conv_bias", False)), dtype)
        else:
            mixer = model.attention(index)  # (q/k norms: the config's qk_norm, eps norm_eps)
        super().__init__(index, mixer)
        self.op_norm = new_param(h, dtype=dtype, fill=1.0)
        self.ffn_norm = new_param(h, dtype=dtype, fill=1.0)
        self.mlp = GatedMLP(h, ffn_size(d), "silu", dtype)

    o_name, state_prefix = "out_proj", "conv."

    def prepare(self, backend: Backend) -> None:
        super().prepare(backend)
        self.mlp.prepare(backend, self.stored)

    def stored_parts(self, p: str) -> dict[str, list[str]]:
        f = p + "feed_forward."
        return {**super().stored_parts(p), "gate_up": [f + "w1.weight", f + "w3.weight"], "down": [f + "w2.weight"]}

    def stored_sites(self, form: str) -> list[tuple[str, nn.Parameter, Any]]:
        return super().stored_sites(form) + mlp_sites(self.mlp, form)

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        be = ctx.batch.backend
        x = self.mix(be.norm(x, self.op_norm, self.eps), ctx, residual=x)
        return self.mlp(be.norm(x, self.ffn_norm, self.eps), be, residual=x)


class Lfm2ForCausalLM(StateSpaceHybrid):
    """LFM2: short-conv and attention layers (q/k norms, RoPE), SwiGLU MLPs, tied embeddings by default."""

    norm_name = "model.embedding_norm.weight"

    def make_layer(self, i: int) -> Lfm2Layer:  # type: ignore[override]
        return Lfm2Layer(i, lfm2_kinds(self.hf)[i], self)

    def load_layer(self, layer: Any, src: WeightSource, p: str) -> None:
        layer.op_norm.data = src.get(p + "operator_norm.weight")
        layer.ffn_norm.data = src.get(p + "ffn_norm.weight")
        if isinstance(layer.mixer, ShortConv):
            layer.mixer.load(src, p + "conv.")
        else:
            load_attention(layer.mixer, src, p + "self_attn.", "out_proj", ("q_layernorm", "k_layernorm"))
        f = p + "feed_forward."
        keep(layer.mlp, "gate_up", src.cat([f + "w1.weight", f + "w3.weight"]))
        keep(layer.mlp, "down", src.part(f + "w2.weight"))
