"""Grouped-query attention with fused Q/K/V, the attention of every Llama-shaped family (MLA is
``layers/mla.py``), and the small helpers the decoder's parameters share."""

from __future__ import annotations

import torch
from torch import nn

from tripod.layers.attention import attend
from tripod.layers.batch import AttnSpec, Backend, ForwardBatch
from tripod.layers.linear import Fp8Scales, Linear, StoredWeight
from tripod.layers.mlp import keep
from tripod.layers.parallel import SINGLE, ParallelGroup, columns, head_split, parameter, rows
from tripod.layers.rotary import RotaryEmbedding
from tripod.layers.weights import WeightSource
from tripod.memory.kv_pool import KVPool
from tripod.models.config import ModelConfig


def new_param(*shape: int, dtype: torch.dtype, fill: float | None = None) -> nn.Parameter:
    """A frozen parameter of ``shape``, uninitialised (or filled with ``fill``), for loading into."""
    t = torch.empty(*shape, dtype=dtype) if fill is None else torch.full(shape, fill, dtype=dtype)
    return nn.Parameter(t, requires_grad=False)


class GQAttention(nn.Module):
    """Grouped-query attention with fused Q/K/V and the family options of ``ModelConfig``."""

    def __init__(self, cfg: ModelConfig, layer: int, qkv_bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * d, cfg.num_kv_heads * d
        self.sinks = new_param(cfg.num_heads, dtype=dtype, fill=0.0) if cfg.attn_sinks else None
        self.spec = AttnSpec(
            cfg.num_heads, cfg.num_kv_heads, cfg.attn_scale,
            window=cfg.sliding_window if cfg.is_sliding(layer) else None, softcap=cfg.attn_softcap, sinks=self.sinks,
        )
        self.eps = cfg.rms_norm_eps
        self.index = layer  # (LoRA sites are per model layer)
        self.qkv = new_param(self.q_size + 2 * self.kv_size, h, dtype=dtype)
        self.qkv_bias = new_param(self.q_size + 2 * self.kv_size, dtype=dtype, fill=0.0) if qkv_bias else None
        self.o = new_param(h, self.q_size, dtype=dtype)
        self.o_bias = new_param(h, dtype=dtype, fill=0.0) if cfg.attention_bias else None
        self.q_norm = new_param(d, dtype=dtype, fill=1.0) if cfg.qk_norm else None
        self.k_norm = new_param(d, dtype=dtype, fill=1.0) if cfg.qk_norm else None
        self.ops: dict[str, tuple[Linear, Linear]] = {}
        self.fp8: dict[str, Fp8Scales] = {}
        self.tp = SINGLE

    def shard(self, tp: ParallelGroup) -> None:
        """Keep this rank's Q heads and the K/V heads they read (column-parallel QKV) and the
        matching columns of O (row-parallel: its output bias, like the residual, on rank 0)."""
        s = self.spec
        d = self.q_size // s.num_heads
        q0, q1, k0, k1 = head_split(s.num_heads, s.num_kv_heads, tp)
        spans = [(q0 * d, q1 * d), (self.q_size + k0 * d, self.q_size + k1 * d),
                 (self.q_size + self.kv_size + k0 * d, self.q_size + self.kv_size + k1 * d)]
        self.qkv = parameter(rows(self.qkv.data, *spans))
        if self.qkv_bias is not None:
            self.qkv_bias = parameter(rows(self.qkv_bias.data, *spans))
        self.o = parameter(columns(self.o.data, q0 * d, q1 * d))
        if self.o_bias is not None and not tp.first:
            self.o_bias = None
        self.q_size, self.kv_size = (q1 - q0) * d, (k1 - k0) * d
        if self.sinks is not None:  # each head's sink goes with the head
            self.sinks = parameter(self.sinks.data[q0:q1].contiguous())
        self.spec = AttnSpec(q1 - q0, k1 - k0, s.scale, window=s.window, softcap=s.softcap, sinks=self.sinks)
        self.ops.clear()
        self.tp = tp

    def prepare(self, backend: Backend, stored: dict[str, StoredWeight]) -> None:
        if backend.form not in self.ops:
            self.ops[backend.form] = (
                backend.linear(self.qkv, self.qkv_bias, stored=stored.get("qkv"), fp8=self.fp8.get("qkv")),
                backend.linear(self.o, self.o_bias, stored=stored.get("o"), fp8=self.fp8.get("o")),
            )

    def release(self, form: str) -> None:
        self.ops.pop(form, None)

    def load(self, src: WeightSource, a: str, offset: bool) -> None:
        get = src.get
        keep(self, "qkv", src.cat([a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"]))
        if self.qkv_bias is not None:
            self.qkv_bias.data = torch.cat([get(a + "q_proj.bias"), get(a + "k_proj.bias"), get(a + "v_proj.bias")])
        keep(self, "o", src.part(a + "o_proj.weight"))
        if self.o_bias is not None:
            self.o_bias.data = get(a + "o_proj.bias")
        if self.sinks is not None:
            self.sinks.data = get(a + "sinks")
        if self.q_norm is not None and self.k_norm is not None:
            self.q_norm.data = norm_weight(get(a + "q_norm.weight"), offset)
            self.k_norm.data = norm_weight(get(a + "k_norm.weight"), offset)

    def forward(self, h: torch.Tensor, layer: int, pool: KVPool, batch: ForwardBatch, rotary: RotaryEmbedding,
                cos_sin: tuple[torch.Tensor, torch.Tensor] | None, residual: torch.Tensor | None) -> torch.Tensor:
        qkv_op, o_op = self.ops[batch.backend.form]
        qk = (self.q_norm, self.k_norm, self.eps) if self.q_norm is not None and self.k_norm is not None else None
        lora = batch.lora
        qkv = qkv_op(h) if lora is None else lora.apply(self.index, "qkv", h, qkv_op(h))
        a = attend(qkv, layer, pool, batch, rotary, cos_sin, self.spec, qk)
        out = o_op(a, residual=self.tp.residual(residual))
        return self.tp.reduce(out if lora is None else lora.apply(self.index, "o", a, out))


def norm_weight(w: torch.Tensor, offset: bool) -> torch.Tensor:
    """Gemma's norms multiply by (1 + w): folded into the weight once (float32 like HF)."""
    if not offset:
        return w
    return (1.0 + w.float()).to(w.dtype)
