"""Qwen3.5 (dense): a hybrid of Gated DeltaNet layers and gated attention layers.

Most layers mix tokens with the gated delta rule (``layers/gated_delta.py``, their state in the
engine's ``StatePool``); every fourth (``layer_types``) attends, with three differences from
Qwen3's attention: ``q_proj`` also gives a per-head output gate (``o_proj(attn * sigmoid(gate))``),
only the first ``rope_dim`` channels of each head rotate (partial rotary), and every RMSNorm
outside the mixer scales by ``(1 + w)`` (folded into the weights at load, as Gemma's).

Partial rotary on tripod's attention: HF rotates channel ``i`` with ``i + rope_dim / 2``; tripod's
RoPE (every backend, the kernels too) pairs ``i`` with ``i + head_dim / 2``. The Q and K rows of
each head (and their norms' weights) are permuted once at load so that HF's rotary pairs land on
tripod's, the pass-through channels in the slots left over, and the rotary table holds cos = 1,
sin = 0 on those: ``x * 1 + y * 0 == x`` exactly. Q·K is unchanged by a permutation applied to both;
V and the output keep HF's order.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from tripod.layers.attention import attend
from tripod.layers.batch import Backend, ForwardBatch
from tripod.layers.gated_delta import GatedDeltaNet
from tripod.layers.linear import Linear, StoredWeight, fuse_rows
from tripod.layers.parallel import SINGLE, ParallelGroup
from tripod.layers.rotary import RotaryEmbedding
from tripod.layers.weights import WeightSource
from tripod.memory.kv_pool import KVPool
from tripod.memory.state_pool import StateSpec
from tripod.models.config import ModelConfig
from tripod.models.gqa import GQAttention, new_param, norm_weight
from tripod.models.hybrid_config import HybridConfig
from tripod.models.llama import DecoderLayer, LlamaForCausalLM, StepContext
from tripod.models.multimodal import split_names


def rotary_permutation(head_dim: int, rope_dim: int) -> torch.Tensor:
    """``perm[j]``: the HF channel that tripod's channel ``j`` of a head holds (see the module doc)."""
    half, rhalf = head_dim // 2, rope_dim // 2
    perm = [-1] * head_dim
    for j in range(rhalf):
        perm[j] = j
        perm[half + j] = rhalf + j
    rest = iter(range(rope_dim, head_dim))
    for j in range(head_dim):
        if perm[j] < 0:
            perm[j] = next(rest)
    return torch.tensor(perm, dtype=torch.long)


def partial_rotary(rotary: RotaryEmbedding, head_dim: int, rope_dim: int) -> RotaryEmbedding:
    """``rotary`` (``rope_dim`` wide) widened to ``head_dim`` in tripod's pairing: cos = 1 and
    sin = 0 on the pass-through channels."""
    if rope_dim == head_dim:
        return rotary
    half, rhalf = head_dim // 2, rope_dim // 2
    cos = torch.ones(rotary.cos.shape[0], head_dim, dtype=rotary.cos.dtype, device=rotary.cos.device)
    sin = torch.zeros_like(cos)
    for dst, src in ((0, 0), (half, rhalf)):
        cos[:, dst : dst + rhalf] = rotary.cos[:, src : src + rhalf]
        sin[:, dst : dst + rhalf] = rotary.sin[:, src : src + rhalf]
    rotary.cos, rotary.sin = cos, sin
    return rotary


class GatedAttention(GQAttention):
    """Qwen3.5's attention: GQA with q/k norms whose ``q_proj`` also yields a sigmoid output gate
    per head, applied before ``o_proj``; Q/K channels permuted for partial rotary (module doc)."""

    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype) -> None:
        if cfg.attention_bias:
            raise ValueError("Qwen3.5 checkpoints with attention biases are not supported")
        super().__init__(cfg, layer, False, dtype)
        assert cfg.hybrid is not None
        self.gate = new_param(self.q_size, cfg.hidden_size, dtype=dtype)
        self.gate_ops: dict[str, Linear] = {}
        self.perm = rotary_permutation(cfg.head_dim, cfg.hybrid.rope_dim)

    def prepare(self, backend: Backend, stored: dict[str, StoredWeight]) -> None:
        super().prepare(backend, stored)
        if backend.form not in self.gate_ops:
            self.gate_ops[backend.form] = backend.linear(self.gate, None, stored=stored.get("gate"))

    def release(self, form: str) -> None:
        super().release(form)
        self.gate_ops.pop(form, None)

    def load(self, src: WeightSource, a: str, offset: bool) -> None:
        s = self.spec
        d = self.q_size // s.num_heads
        hidden = self.gate.shape[1]
        qg = src.get(a + "q_proj.weight").view(s.num_heads, 2, d, hidden)  # per head: query rows, then gate rows
        q = qg[:, 0][:, self.perm].reshape(-1, hidden)
        k = src.get(a + "k_proj.weight").view(s.num_kv_heads, d, hidden)[:, self.perm].reshape(-1, hidden)
        self.qkv.data = torch.cat([q, k, src.get(a + "v_proj.weight")]).contiguous()
        self.gate.data = qg[:, 1].reshape(-1, hidden).contiguous()
        self.o.data = src.get(a + "o_proj.weight").contiguous()
        assert self.q_norm is not None and self.k_norm is not None
        self.q_norm.data = norm_weight(src.get(a + "q_norm.weight"), offset)[self.perm].contiguous()
        self.k_norm.data = norm_weight(src.get(a + "k_norm.weight"), offset)[self.perm].contiguous()

    def forward(self, h: torch.Tensor, layer: int, pool: KVPool, batch: ForwardBatch, rotary: RotaryEmbedding,
                cos_sin: tuple[torch.Tensor, torch.Tensor] | None, residual: torch.Tensor | None) -> torch.Tensor:
        form = batch.backend.form
        qkv_op, o_op = self.ops[form]
        assert self.q_norm is not None and self.k_norm is not None
        a = attend(qkv_op(h), layer, pool, batch, rotary, cos_sin, self.spec, (self.q_norm, self.k_norm, self.eps))
        a = a * torch.sigmoid(self.gate_ops[form](h))
        return o_op(a, residual=residual)


class LinearDecoderLayer(DecoderLayer):
    """A decoder layer whose token mixer is the gated delta rule (its state in the step's
    ``StateRows``) instead of attention."""

    def prepare(self, backend: Backend) -> None:
        assert isinstance(self.attn, GatedDeltaNet)
        self.attn.prepare(backend, self.stored)
        self.mlp.prepare(backend, self.stored)

    def _attend(self, h: torch.Tensor, ctx: StepContext, rotary: RotaryEmbedding,
                cos_sin: tuple[torch.Tensor, torch.Tensor] | None, residual: torch.Tensor | None) -> torch.Tensor:
        states = ctx.batch.states
        assert states is not None, "a hybrid model's step carries its requests' state slots"
        return self.attn(h, states, ctx.batch.backend, residual)


class Qwen3_5ForCausalLM(LlamaForCausalLM):
    """Qwen3.5 dense: ``LlamaForCausalLM``'s embedding, MLP, norms and head; gated-delta-rule
    layers and gated attention layers (whose K/V are the pool's layers, in order)."""

    # Every linear layer records its state after each verified row (memory/state_pool.StateTrace):
    # speculative verification and jump-forward roll a rejection back exactly.
    traces_states = True

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(cfg, dtype, device)
        hy = self.hybrid
        self.rotary = partial_rotary(self.rotary, cfg.head_dim, hy.rope_dim)
        pool_layer = 0
        for layer in self.layers:
            if not hy.is_linear(layer.layer):
                layer.pool_layer = pool_layer
                pool_layer += 1

    @property
    def hybrid(self) -> HybridConfig:
        assert self.cfg.hybrid is not None
        return self.cfg.hybrid

    @property
    def rope_dim(self) -> int:
        return self.cfg.hybrid.rope_dim if self.cfg.hybrid is not None else self.cfg.head_dim

    def state_spec(self) -> StateSpec:
        """Every linear layer's per-sequence state, in layer order (the ``StatePool``'s layout)."""
        return StateSpec(tuple(layer.attn.state_shapes() for layer in self.layers
                               if isinstance(layer.attn, GatedDeltaNet)))

    def make_layer(self, i: int) -> DecoderLayer:
        cfg, hy = self.cfg, self.hybrid
        if not hy.is_linear(i):
            return DecoderLayer(cfg, i, GatedAttention(cfg, i, self.dtype), self.dtype)
        index = hy.linear_layers.index(i)
        mixer = GatedDeltaNet(cfg.hidden_size, hy.k_heads, hy.v_heads, hy.k_dim, hy.v_dim, hy.conv_kernel,
                              cfg.rms_norm_eps, index, self.dtype)
        return LinearDecoderLayer(cfg, i, mixer, self.dtype)

    def load_stored(self, stored: Mapping[str, StoredWeight]) -> None:
        """A GGUF's blocks (HF names and row order, ``loader/gguf_hybrid.py``): the MLP's and the head's
        as ``LlamaForCausalLM`` keeps them; an attention layer's query, gate and key rows taken apart
        and permuted as ``GatedAttention.load`` does with the weights (whole rows of blocks); a linear
        layer's ``in_proj`` (Q|K|V, Z, B, A fused) and ``out_proj``. A part left unquantized by the
        converter runs its fused projection dequantized."""
        super().load_stored(stored)
        for layer in self.layers:
            a = f"model.layers.{layer.layer}."
            layer.stored.pop("qkv", None)
            if isinstance(layer.attn, GatedDeltaNet):
                names = [a + f"linear_attn.in_proj_{n}.weight" for n in ("qkv", "z", "b", "a")]
                for key, parts in (("in_proj", names), ("out_proj", [a + "linear_attn.out_proj.weight"])):
                    fused = fuse_rows([stored.get(n) for n in parts])
                    if fused is not None:
                        layer.stored[key] = fused
                continue
            attn = layer.attn
            assert isinstance(attn, GatedAttention)
            q, k, v = (stored.get(a + f"self_attn.{n}_proj.weight") for n in "qkv")
            if q is None or k is None or v is None:
                continue
            s = attn.spec
            d = attn.q_size // s.num_heads
            qg = q.blocks.view(s.num_heads, 2, d, -1)
            rows = [qg[:, 0][:, attn.perm].reshape(-1, qg.shape[-1]),
                    k.blocks.view(s.num_kv_heads, d, -1)[:, attn.perm].reshape(-1, qg.shape[-1])]
            query, key = (StoredWeight(q.kind, r.contiguous(), (r.shape[0], q.shape[1])) for r in rows)
            qkv = fuse_rows([query, key, v])
            if qkv is not None:
                layer.stored["qkv"] = qkv
            gate = qg[:, 1].reshape(-1, qg.shape[-1]).contiguous()
            layer.stored["gate"] = StoredWeight(q.kind, gate, (gate.shape[0], q.shape[1]))

    def load_attention(self, layer: DecoderLayer, src: WeightSource, p: str) -> None:
        if isinstance(layer.attn, GatedDeltaNet):
            layer.attn.load(src, p + "linear_attn.")
            return
        super().load_attention(layer, src, p)


class Qwen3_5ForConditionalGeneration(Qwen3_5ForCausalLM):
    """The text part of a Qwen3.5 multimodal folder (``model.language_model.*``; the vision
    tower's weights are not read: images are not accepted)."""

    def load_weights(self, weights: Mapping[str, torch.Tensor], fp8_block: tuple[int, int] | None = None,
                     tp: ParallelGroup = SINGLE, expert_parallel: bool = False) -> None:
        text, _ = split_names(weights)
        super().load_weights(text, fp8_block, tp, expert_parallel)
