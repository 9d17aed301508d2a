"""MiniMax (``MiniMaxForCausalLM``, MiniMax-Text-01): lightning-attention layers beside softmax
attention layers, a Mixtral-style MoE on every layer.

The linear layers (``layer_types``: ``linear_attention``) mix tokens with lightning attention
(``layers/lightning.py``; its ``[H, d, d]`` state per sequence in the engine's ``StatePool``); the
others attend as Mixtral does (GQA, RoPE) over the KV pool, whose layers are those attention layers
in order. The block differs from Llama's: the residual is the *normed* input, and both sums are
weighted (``*_alpha_factor``, ``*_beta_factor``)::

    h = norm1(x);  h = h · α_attn + mixer(h) · β_attn
    h = norm2(h);  out = h · α_mlp + moe(h) · β_mlp
"""

from __future__ import annotations

import torch

from tripod.layers.batch import Backend
from tripod.layers.lightning import LightningAttention, LightningConfig
from tripod.layers.rotary import RotaryEmbedding
from tripod.layers.weights import WeightSource
from tripod.memory.state_pool import StateSpec
from tripod.models.config import ModelConfig
from tripod.models.gqa import GQAttention
from tripod.models.hybrid import mix_on_slots, number_layers
from tripod.models.hybrid_config import HybridConfig
from tripod.models.llama import DecoderLayer, LlamaForCausalLM, StepContext

LIGHTNING_NORM_EPS = 1e-6  # transformers' RMSNorm default: MiniMax builds the mixer's norm without an eps


class MiniMaxLayer(DecoderLayer):
    """One MiniMax layer: lightning attention (its state at ``state_index``) or GQA (its K/V at
    ``pool_layer``), then the MoE, with MiniMax's weighted residuals on the normed input."""

    def __init__(self, cfg: ModelConfig, layer: int, attn: LightningAttention | GQAttention,
                 alphas: tuple[float, float, float, float], dtype: torch.dtype) -> None:
        super().__init__(cfg, layer, attn, dtype)
        self.state_index = -1
        self.attn_alpha, self.attn_beta, self.mlp_alpha, self.mlp_beta = alphas

    def prepare(self, backend: Backend) -> None:
        if isinstance(self.attn, LightningAttention):
            self.attn.prepare(backend)
        else:
            self.attn.prepare(backend, self.stored)
        self.mlp.prepare(backend, self.stored)

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        be = ctx.batch.backend
        h = be.norm(x, self.input_norm, self.eps)
        rotary, cos_sin = ctx.rope(self.layer)
        a = self._attend(h, ctx, rotary, cos_sin, residual=None)
        h = h * self.attn_alpha + a * self.attn_beta
        h = be.norm(h, self.post_norm, self.eps)
        return h * self.mlp_alpha + self._mlp(h, ctx, residual=None) * self.mlp_beta

    def _attend(self, h: torch.Tensor, ctx: StepContext, rotary: RotaryEmbedding,
                cos_sin: tuple[torch.Tensor, torch.Tensor] | None, residual: torch.Tensor | None) -> torch.Tensor:
        batch = ctx.batch
        if isinstance(self.attn, GQAttention):
            return self.attn(h, self.pool_layer, ctx.pool, batch, rotary, cos_sin, residual)
        states = batch.states
        assert states is not None, "a hybrid model's step carries its requests' state slots"
        mixer = self.attn
        return mix_on_slots(states, self.state_index, h.shape[0], lambda held, lens, trace: mixer(
            h, batch.backend, held[0], lens, residual=residual, trace=trace))


class MiniMaxForCausalLM(LlamaForCausalLM):
    """MiniMax: Mixtral's decoder with lightning attention on the config's linear layers and
    MiniMax's weighted residuals (module doc)."""

    # Every lightning layer records its state after each verified row (memory/state_pool.StateTrace):
    # speculative verification and jump-forward roll a rejection back exactly.
    traces_states = True

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        if cfg.hybrid is None or cfg.hybrid.hf is None:
            raise ValueError("MiniMaxForCausalLM is built from its HF config (model_type minimax)")
        super().__init__(cfg, dtype, device)
        number_layers(self.layers, lambda layer: "attention" if isinstance(layer.attn, GQAttention) else "state")

    @property
    def hybrid(self) -> HybridConfig:
        assert self.cfg.hybrid is not None
        return self.cfg.hybrid

    def make_layer(self, i: int) -> DecoderLayer:
        cfg, hy = self.cfg, self.hybrid
        d = hy.hf or {}
        kind = "linear_attn" if hy.is_linear(i) else "full_attn"
        alphas = (float(d.get(f"{kind}_alpha_factor", 1)), float(d.get(f"{kind}_beta_factor", 1)),
                  float(d.get("mlp_alpha_factor", 1)), float(d.get("mlp_beta_factor", 1)))
        attn: LightningAttention | GQAttention
        if hy.is_linear(i):
            lc = LightningConfig(cfg.hidden_size, cfg.num_heads, cfg.head_dim, i, cfg.num_layers, LIGHTNING_NORM_EPS)
            attn = LightningAttention(lc, self.dtype)
        else:
            attn = GQAttention(cfg, i, cfg.attention_bias, self.dtype)
        return MiniMaxLayer(cfg, i, attn, alphas, self.dtype)

    def state_spec(self) -> StateSpec:
        """Every lightning layer's per-sequence state, in layer order."""
        return StateSpec(tuple(layer.attn.cfg.state_shapes() for layer in self.layers
                               if isinstance(layer.attn, LightningAttention)))

    def load_attention(self, layer: DecoderLayer, src: WeightSource, p: str) -> None:
        if isinstance(layer.attn, LightningAttention):
            layer.attn.load(src, p + "self_attn.")
            return
        super().load_attention(layer, src, p)
