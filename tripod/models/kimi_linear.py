"""Kimi Linear (``KimiLinearForCausalLM``): Kimi Delta Attention layers beside multi-head latent
attention layers, DeepSeek-V3's MoE.

Most layers mix tokens with KDA (``layers/kda.py``: a gated delta rule with a per-channel decay,
short convolutions over Q, K and V; its state per sequence in the engine's ``StatePool``); every
few layers (``layer_types``) attend with MLA (``layers/mla.py``) over the latent KV pool, whose
layers are those attention layers in order. The MLA has **no positional encoding** (NoPE): the
shared "rope" key channels are stored and attended as they come, never rotated, so the model's
rotary is ``NoRotary`` and a step computes no cos/sin tables. The MLP is dense in the first
``first_k_dense_replace`` layers (``mlp_layer_types``) and V3's MoE elsewhere (sigmoid scores
with a correction bias, group-limited top-k, shared experts, ``routed_scaling_factor``).

Weight names: the files name the MLP ``block_sparse_moe`` (experts ``w1``/``w3``/``w2``, as
Mixtral) and the KDA short conv per part (``q_conv1d``, ``k_conv1d``, ``v_conv1d``); transformers'
in-memory names (``mlp``, one ``conv1d``) are read too.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from tripod.layers.batch import Backend
from tripod.layers.kda import PROJECTIONS, KdaConfig, KdaMixer
from tripod.layers.linear import StoredWeight, fuse_rows
from tripod.layers.mla import MLAttention
from tripod.layers.mlp import GatedMLP
from tripod.layers.rotary import RotaryEmbedding
from tripod.layers.weights import WeightSource
from tripod.memory.state_pool import StateSpec
from tripod.models.config import ModelConfig
from tripod.models.deepseek import DeepseekForCausalLM
from tripod.models.hybrid import mix_on_slots, mlp_sites, number_layers
from tripod.models.hybrid_config import HybridConfig
from tripod.models.llama import DecoderLayer, StepContext


class NoRotary(RotaryEmbedding):
    """The rotary of a model without positional encoding: no tables (a step's ``cos_sin`` is None)."""

    def __init__(self) -> None:  # (no tables to build: nothing rotates)
        self.cos = self.sin = torch.empty(0)
        self.max_position = 0

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> None:  # type: ignore[override]
        return None


class KimiLayer(DecoderLayer):
    """One Kimi Linear layer: its mixer (KDA, its state in the step's ``StateRows`` at
    ``state_index``; or MLA, its latents at ``pool_layer``), then the dense MLP or the MoE."""

    def __init__(self, cfg: ModelConfig, layer: int, attn: KdaMixer | MLAttention, dtype: torch.dtype) -> None:
        super().__init__(cfg, layer, attn, dtype)
        self.state_index = -1

    def prepare(self, backend: Backend) -> None:
        if isinstance(self.attn, KdaMixer):
            self.attn.prepare(backend, self.stored)
        else:
            self.attn.prepare(backend, self.stored)
        self.mlp.prepare(backend, self.stored)

    def _attend(self, h: torch.Tensor, ctx: StepContext, rotary: RotaryEmbedding,
                cos_sin: tuple[torch.Tensor, torch.Tensor] | None, residual: torch.Tensor | None) -> torch.Tensor:
        batch = ctx.batch
        if isinstance(self.attn, MLAttention):
            assert residual is not None
            return self.attn(h, self.pool_layer, ctx.pool, batch, cos_sin, residual)
        states = batch.states
        assert states is not None, "a hybrid model's step carries its requests' state slots"
        kda = self.attn
        if batch.backend.recurrent_kernels:  # the kernels read and write the slots in place
            return kda.forward_slots(h, batch.backend, states, self.state_index, residual=residual)
        return mix_on_slots(states, self.state_index, h.shape[0], lambda held, lens, trace: kda(
            h, batch.backend, held[0], held[1], lens, residual=residual, trace=trace))


class KimiLinearForCausalLM(DeepseekForCausalLM):
    """Kimi Linear: DeepSeek's decoder (MLA, V3 MoE) with KDA layers in place of attention on the
    config's ``linear_attention`` layers; the MLA layers' latents are the pool's layers, in order."""

    # Every KDA layer records its state after each verified row (memory/state_pool.StateTrace):
    # speculative verification and jump-forward roll a rejection back exactly.
    traces_states = True

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        if cfg.hybrid is None or cfg.mla is None or not cfg.mla.nope:
            raise ValueError("KimiLinearForCausalLM is built from its HF config (model_type kimi_linear)")
        super().__init__(cfg, dtype, device)
        self.rotary = NoRotary()  # (NoPE: the table the base class built is dropped)
        number_layers(self.layers, lambda layer: "attention" if isinstance(layer.attn, MLAttention) else "state")

    @property
    def hybrid(self) -> HybridConfig:
        assert self.cfg.hybrid is not None
        return self.cfg.hybrid

    def make_layer(self, i: int) -> DecoderLayer:
        cfg, hy = self.cfg, self.hybrid
        if hy.is_linear(i):
            kda = KdaMixer(KdaConfig(cfg.hidden_size, hy.k_heads, hy.k_dim, hy.conv_kernel, cfg.rms_norm_eps), self.dtype)
            return KimiLayer(cfg, i, kda, self.dtype)
        attn = super().make_layer(i).attn
        assert isinstance(attn, MLAttention)
        return KimiLayer(cfg, i, attn, self.dtype)

    def state_spec(self) -> StateSpec:
        """Every KDA layer's per-sequence state (conv window, recurrent state), in layer order."""
        return StateSpec(tuple(layer.attn.cfg.state_shapes() for layer in self.layers
                               if isinstance(layer.attn, KdaMixer)))

    def load_stored(self, stored: Mapping[str, StoredWeight]) -> None:
        """A GGUF's codes (``loader/gguf_kimi.py``): ``LlamaForCausalLM``'s sites (the dense MLPs, the
        MoE's routed and shared experts, the head; a KDA layer's Q|K|V and output) and the KDA layer's
        low-rank gate projections (``f_a`` / ``f_b``, ``b``, ``g_a`` / ``g_b``), each as it is stored
        (no transform). An MLA layer's projections stay dense, as for DeepSeek GGUFs (its ``kv_b`` is
        stored transposed per head by the converter: no whole-row form of it exists)."""
        super().load_stored(stored)
        for layer in self.layers:
            if not isinstance(layer.attn, KdaMixer):
                layer.stored.pop("qkv", None)
                layer.stored.pop("o", None)
                continue
            a = f"model.layers.{layer.layer}.self_attn."
            for n in ("f_a", "f_b", "b", "g_a", "g_b"):
                sw = fuse_rows([stored.get(f"{a}{n}_proj.weight")])
                if sw is not None:
                    layer.stored[n] = sw

    def stored_sites(self, layer: Any, form: str) -> Iterator[tuple[str, nn.Parameter, Any]]:
        kda = layer.attn
        if isinstance(kda, KdaMixer) and form in kda.ops:
            yield from ((n, getattr(kda, n), kda.ops[form][n]) for n in PROJECTIONS if n in layer.stored)
        if isinstance(layer.mlp, GatedMLP):
            yield from mlp_sites(layer.mlp, form)

    def load_attention(self, layer: DecoderLayer, src: WeightSource, p: str) -> None:
        if isinstance(layer.attn, KdaMixer):
            layer.attn.load(src, p + "self_attn.")
            return
        super().load_attention(layer, src, p)

    def load_mlp(self, layer: DecoderLayer, src: WeightSource, p: str) -> None:
        if isinstance(layer.mlp, GatedMLP) and src.has(p + "block_sparse_moe.gate_proj.weight"):
            layer.mlp.load(src, p + "block_sparse_moe.")  # (the files' name for a dense layer's MLP too)
            return
        super().load_mlp(layer, src, p)
