"""The Llama family (Llama 2/3, Mistral, Qwen2, SmolLM): RMSNorm, RoPE, GQA, SwiGLU.

Runs over a flat batch (``ForwardBatch``) that mixes decode tokens and prefill chunks. Q/K/V
and gate/up projections are fused into one matmul each; logits are computed only for the
tokens the sampler needs.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tripod.layers.attention import ForwardBatch, attend
from tripod.layers.linear import Form, Linear, StoredWeight, make_linear
from tripod.layers.rotary import RotaryEmbedding
from tripod.memory.kv_pool import KVPool
from tripod.models.config import ModelConfig


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype != torch.float32:
        # The fused kernel: float32 inside, one rounding at the end (HF rounds once more,
        # before the weight; the difference is below bf16's own resolution).
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    # NOTE: float32 follows HF's LlamaRMSNorm op for op, so fp32 parity is exact.
    h = x
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h


class LlamaLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, qkv_bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        if cfg.mlp_bias:
            raise ValueError("checkpoints with MLP biases (mlp_bias=true) are not supported yet")
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_size = cfg.num_heads * d
        self.kv_size = cfg.num_kv_heads * d
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.eps = cfg.rms_norm_eps
        self.input_norm = nn.Parameter(torch.ones(h, dtype=dtype), requires_grad=False)
        self.post_norm = nn.Parameter(torch.ones(h, dtype=dtype), requires_grad=False)
        self.qkv = nn.Parameter(torch.empty(self.q_size + 2 * self.kv_size, h, dtype=dtype), requires_grad=False)
        self.qkv_bias = (
            nn.Parameter(torch.zeros(self.q_size + 2 * self.kv_size, dtype=dtype), requires_grad=False)
            if qkv_bias
            else None
        )
        self.o = nn.Parameter(torch.empty(h, self.q_size, dtype=dtype), requires_grad=False)
        self.o_bias = (
            nn.Parameter(torch.zeros(h, dtype=dtype), requires_grad=False) if cfg.attention_bias else None
        )
        i = cfg.intermediate_size
        self.gate_up = nn.Parameter(torch.empty(2 * i, h, dtype=dtype), requires_grad=False)
        self.down = nn.Parameter(torch.empty(h, i, dtype=dtype), requires_grad=False)
        self.inter = i
        self.scale = d**-0.5
        # Executable forms of the projections (see LlamaForCausalLM.prepare), and the GGUF
        # blocks of the fused projections when the model was loaded with its stored weights.
        self.ops: dict[Form, LayerOps] = {}
        self.stored: dict[str, StoredWeight] = {}

    def prepare(self, form: Form, kernel_ops: Any = None) -> None:
        """Build the projections' executable form (after the weights are loaded)."""
        if form in self.ops:
            return
        st = self.stored.get

        def mk(w: torch.Tensor, b: torch.Tensor | None, name: str) -> Linear:
            return make_linear(w, b, form, ops=kernel_ops, stored=st(name))

        self.ops[form] = LayerOps(
            qkv=mk(self.qkv, self.qkv_bias, "qkv"),
            o=mk(self.o, self.o_bias, "o"),
            gate_up=mk(self.gate_up, None, "gate_up"),
            down=mk(self.down, None, "down"),
        )

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor] | None,
        rotary: RotaryEmbedding,
        layer: int,
        pool: KVPool,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        ops = self.ops[batch.form]
        k = batch.kernel_ops
        h = k.rms_norm(x, self.input_norm, self.eps) if k is not None else rms_norm(x, self.input_norm, self.eps)
        qkv = ops.qkv(h)
        a = attend(qkv, layer, pool, batch, rotary, cos_sin, self.num_heads, self.num_kv_heads, self.scale)
        x = ops.o(a, residual=x)
        h = k.rms_norm(x, self.post_norm, self.eps) if k is not None else rms_norm(x, self.post_norm, self.eps)
        gu = ops.gate_up(h)
        if k is not None:
            act = k.silu_mul(gu)
        else:
            g, u = gu.split([self.inter, self.inter], dim=-1)
            act = F.silu(g) * u
        return ops.down(act, residual=x)


class LayerOps:
    """A layer's projections in executable form (``layers.linear``)."""

    __slots__ = ("down", "gate_up", "o", "qkv")

    def __init__(self, qkv: Linear, o: Linear, gate_up: Linear, down: Linear) -> None:
        self.qkv, self.o, self.gate_up, self.down = qkv, o, gate_up, down


class LlamaForCausalLM(nn.Module):
    """Owns the weights; ``forward`` returns logits (float32) for ``batch.logits_idx``."""

    qkv_bias = False

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.cfg = cfg
        self.dtype = dtype
        self.device = device
        qkv_bias = self.qkv_bias or cfg.attention_bias
        self.embed = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype), requires_grad=False)
        self.layers = nn.ModuleList(LlamaLayer(cfg, qkv_bias, dtype) for _ in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size, dtype=dtype), requires_grad=False)
        self.lm_head: torch.Tensor | None = None
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Parameter(
                torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype), requires_grad=False
            )
        self.rotary = RotaryEmbedding(
            cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings, device
        )
        self.head_ops: dict[Form, Linear] = {}
        self.stored_head: StoredWeight | None = None

    def prepare(self, form: Form, kernel_ops: Any = None) -> None:
        """Build every projection's executable form (``layers.linear.Form``). Several forms may
        coexist: engines sharing one loaded model may run different paths, and a runner moves
        from ``onednn`` to ``kernel`` when the kernels finish building."""
        for layer in self.layers:
            layer.prepare(form, kernel_ops)
        if form not in self.head_ops:
            head = self.embed if self.lm_head is None else self.lm_head
            self.head_ops[form] = make_linear(head, None, form, ops=kernel_ops, stored=self.stored_head)

    def truncated(self, num_layers: int) -> LlamaForCausalLM:
        """A view of this model with only its first ``num_layers`` layers, sharing every weight
        (and the final norm and head): a self-speculative draft whose K/V are exactly this
        model's first layers' K/V."""
        if not 1 <= num_layers < self.cfg.num_layers:
            raise ValueError(f"a truncated draft needs 1 to {self.cfg.num_layers - 1} layers (got {num_layers})")
        view = copy.copy(self)
        # NOTE: nn.Module keeps submodules in dicts; copy them so the view's layer list is its own.
        view._modules = dict(self._modules)
        view._parameters = dict(self._parameters)
        view.layers = nn.ModuleList(list(self.layers)[:num_layers])
        return view

    def release(self, form: Form) -> None:
        """Forget a form's packed weights (the runner moved on from it: memory back)."""
        for layer in self.layers:
            layer.ops.pop(form, None)
        self.head_ops.pop(form, None)

    @property
    def has_stored_weights(self) -> bool:
        return self.stored_head is not None or any(layer.stored for layer in self.layers)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, pool: KVPool) -> torch.Tensor:
        x = F.embedding(batch.input_ids, self.embed)
        cos_sin = None if batch.kernel is not None else self.rotary.tables(batch.positions, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer.forward(x, cos_sin, self.rotary, i, pool, batch)
        if batch.logits_idx is not None:
            x = x.index_select(0, batch.logits_idx)
        k = batch.kernel_ops
        eps = self.cfg.rms_norm_eps
        x = k.rms_norm(x, self.norm, eps) if k is not None else rms_norm(x, self.norm, eps)
        return self.head_ops[batch.form](x).float()

    # ------------------------------------------------------------------ weights
    def load_stored(self, stored: Mapping[str, StoredWeight]) -> None:
        """Keep the GGUF blocks of the projections (HF names, rows already in HF order) so the
        ``stored`` form can execute them. Fused projections (QKV, gate/up) are kept only when
        every part is stored in the same type; the others run on the dequantized weights."""

        def fuse(names: list[str]) -> StoredWeight | None:
            parts = [stored.get(n) for n in names]
            if any(p is None for p in parts) or len({p.kind for p in parts if p}) != 1:
                return None
            ps = [p for p in parts if p is not None]
            k = ps[0].shape[1]
            if any(p.shape[1] != k for p in ps):
                return None
            blocks = torch.cat([p.blocks for p in ps]) if len(ps) > 1 else ps[0].blocks
            return StoredWeight(ps[0].kind, blocks.contiguous(), (sum(p.shape[0] for p in ps), k))

        for i, layer in enumerate(self.layers):
            a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
            found = {
                "qkv": fuse([a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"]),
                "o": fuse([a + "o_proj.weight"]),
                "gate_up": fuse([m + "gate_proj.weight", m + "up_proj.weight"]),
                "down": fuse([m + "down_proj.weight"]),
            }
            layer.stored = {k: v for k, v in found.items() if v is not None}
        tied = self.lm_head is None or self.lm_head.data_ptr() == self.embed.data_ptr()
        self.stored_head = fuse(["model.embed_tokens.weight" if tied else "lm_head.weight"])

    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Load HF-named tensors (``model.layers.N.self_attn.q_proj.weight`` …), fusing Q/K/V
        and gate/up. Every parameter must be covered; a missing one is an error, not zeros."""

        def get(name: str) -> torch.Tensor:
            if name not in weights:
                raise ValueError(f"checkpoint is missing tensor {name!r}")
            return weights[name].to(device=self.device, dtype=self.dtype)

        self.embed.data = get("model.embed_tokens.weight").contiguous()
        self.norm.data = get("model.norm.weight")
        if self.lm_head is not None:
            if "lm_head.weight" in weights:
                self.lm_head.data = get("lm_head.weight").contiguous()
            else:  # some checkpoints tie without saying so
                self.lm_head.data = self.embed.data
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            layer.input_norm.data = get(p + "input_layernorm.weight")
            layer.post_norm.data = get(p + "post_attention_layernorm.weight")
            a = p + "self_attn."
            layer.qkv.data = torch.cat(
                [get(a + "q_proj.weight"), get(a + "k_proj.weight"), get(a + "v_proj.weight")]
            ).contiguous()
            if layer.qkv_bias is not None:
                layer.qkv_bias.data = torch.cat(
                    [get(a + "q_proj.bias"), get(a + "k_proj.bias"), get(a + "v_proj.bias")]
                )
            layer.o.data = get(a + "o_proj.weight").contiguous()
            if layer.o_bias is not None:
                layer.o_bias.data = get(a + "o_proj.bias")
            m = p + "mlp."
            layer.gate_up.data = torch.cat(
                [get(m + "gate_proj.weight"), get(m + "up_proj.weight")]
            ).contiguous()
            layer.down.data = get(m + "down_proj.weight").contiguous()


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: Llama with biases on the Q/K/V projections."""

    qkv_bias = True
