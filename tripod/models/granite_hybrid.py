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
from tripod.layers.linear import StoredWeight
from tripod.layers.mamba2 import Mamba2Config, Mamba2Mixer
from tripod.layers.mlp import GatedMLP, keep
from tripod.layers.moe import MoE, MoEConfig
from tripod.layers.weights import WeightSource
from tripod.models.config import ModelConfig
from tripod.models.gqa import GQAttention, new_param
from tripod.models.hybrid import (
    HybridLayer,
    StateSpaceHybrid,
    load_attention,
    mamba_config,
    mlp_sites,
)
from tripod.models.hybrid_config import granite_kinds, granite_rope
from tripod.models.llama import StepContext


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

    def __init__(self, index: int, kind: str, model: GraniteMoeHybridForCausalLM) -> None:
        d, dtype = model.hf, model.dtype
        h = d["hidden_size"]
        if kind == "linear_attention":
            mixer: Mamba2Mixer | GQAttention = Mamba2Mixer(granite_mamba(d), dtype)
        else:
            mixer = model.attention(index, scale=float(d.get("attention_multiplier", 1.0)))
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
        self.shared.prepare(backend, self.stored)
        if self.moe is not None:
            self.moe.prepare(backend, {})

    def stored_parts(self, p: str) -> dict[str, list[str]]:
        s = p + "shared_mlp."
        return {**super().stored_parts(p), "gate_up": [s + "input_linear.weight"], "down": [s + "output_linear.weight"]}

    def stored_sites(self, form: str) -> list[tuple[str, nn.Parameter, Any]]:
        return super().stored_sites(form) + mlp_sites(self.shared, form)

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        be = ctx.batch.backend
        x = x + self.mix(be.norm(x, self.input_norm, self.eps), ctx) * self.mult
        h = be.norm(x, self.post_norm, self.eps)
        out = self.shared(h, be)
        if self.moe is not None:
            out = self.moe(h, be) + out
        return x + out * self.mult


class GraniteMoeHybridForCausalLM(StateSpaceHybrid):
    """Granite 4.0 hybrid: Mamba2 and attention layers, MoE + shared MLP, Granite's multipliers."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        assert cfg.hybrid is not None and cfg.hybrid.hf is not None
        self.uses_rope = granite_rope(cfg.hybrid.hf)
        super().__init__(cfg, dtype, device)
        self.set_embed_mult(float(self.hf.get("embedding_multiplier", 1.0)))
        self.logits_div = float(self.hf.get("logits_scaling", 1.0))

    def make_layer(self, i: int) -> GraniteHybridLayer:  # type: ignore[override]
        return GraniteHybridLayer(i, granite_kinds(self.hf)[i], self)

    def load_stored_experts(self, layer: Any, stored: Mapping[str, StoredWeight]) -> None:
        """The routed experts' codes, per expert (``loader/gguf_loader.py`` splits the file's stacks by
        whole rows of blocks), where every expert's gate, up and down are stored in one kind."""
        if layer.moe is not None:
            layer.moe.experts.load_stored(stored, f"model.layers.{layer.layer}.block_sparse_moe.experts.",
                                          ("gate_proj", "up_proj", "down_proj"))

    def load_layer(self, layer: Any, src: WeightSource, p: str) -> None:
        layer.input_norm.data = src.get(p + "input_layernorm.weight")
        layer.post_norm.data = src.get(p + "post_attention_layernorm.weight")
        if isinstance(layer.mixer, Mamba2Mixer):
            layer.mixer.load(src, p + "mamba.")
        else:
            load_attention(layer.mixer, src, p + "self_attn.")
        keep(layer.shared, "gate_up", src.part(p + "shared_mlp.input_linear.weight"))
        keep(layer.shared, "down", src.part(p + "shared_mlp.output_linear.weight"))
        if layer.moe is not None:
            m = p + "block_sparse_moe."
            if src.has(m + "input_linear.weight"):  # the checkpoint files' stacked form: gate|up, down
                layer.moe.router.data = src.get_f32(m + "router.layer.weight")
                keep(layer.moe.experts, "gate_up", src.part(m + "input_linear.weight"))
                keep(layer.moe.experts, "down", src.part(m + "output_linear.weight"))
            else:
                layer.moe.router.data = src.get_f32(m + "router.weight")
                layer.moe.experts.load(src, m + "experts.", ("gate_proj", "up_proj", "down_proj"))
