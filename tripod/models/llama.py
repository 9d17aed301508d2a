"""The decoder every supported family is built from, and the Llama-shaped families themselves.

A layer is norm → attention → residual, norm → MLP → residual, over a flat batch
(``ForwardBatch``) that mixes decode tokens and prefill chunks. Its parts come from the config:

- attention: GQA with fused Q/K/V (biases for Qwen2; per-head q/k RMSNorm for Qwen3 and Gemma 3;
  a sliding window on the layers that have one; Gemma's scale and soft-cap), or MLA
  (``models/deepseek.py``);
- MLP: the gated MLP (SwiGLU or GELU-tanh) or a mixture of experts (``layers/moe.py``) — Mixtral,
  Qwen2-MoE (shared expert with its gate), Qwen3-MoE, DeepSeek;
- Gemma's extras: (1 + w) norms, norms around both sublayers' outputs ("sandwich"), scaled
  embeddings, per-layer-type RoPE bases, final-logit soft-cap.

Logits are computed only for the tokens the sampler needs (none for a prompt's non-final chunks).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tripod.layers.batch import Backend, ForwardBatch
from tripod.layers.linear import Linear, StoredWeight, fuse_rows, release_sites
from tripod.layers.mlp import GatedMLP
from tripod.layers.moe import MoE
from tripod.layers.norm import rms_norm
from tripod.layers.parallel import (
    SINGLE,
    SINGLE_STAGE,
    DPLayout,
    ParallelGroup,
    PipeStage,
    parameter,
)
from tripod.layers.rotary import RotaryEmbedding
from tripod.layers.weights import WeightSource
from tripod.models.config import ModelConfig
from tripod.models.gqa import GQAttention, new_param, norm_weight

__all__ = ["LlamaForCausalLM", "rms_norm"]


class DecoderLayer(nn.Module):
    """Norms, attention and MLP of one layer. ``sandwich``: Gemma's extra norms on both
    sublayers' outputs (before their residual adds)."""

    def __init__(self, cfg: ModelConfig, layer: int, attn: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        if cfg.mlp_bias:
            raise ValueError("checkpoints with MLP biases (mlp_bias=true) are not supported yet")
        h = cfg.hidden_size
        self.layer = layer
        self.pool_layer = layer  # its K/V's layer in the pool (a pipeline stage's pool holds its layers only)
        self.eps = cfg.rms_norm_eps
        self.sandwich = cfg.sandwich_norms
        self.input_norm = new_param(h, dtype=dtype, fill=1.0)
        self.post_norm = new_param(h, dtype=dtype, fill=1.0)  # before the MLP (HF's post_attention_layernorm)
        self.attn_out_norm = new_param(h, dtype=dtype, fill=1.0) if self.sandwich else None
        self.mlp_out_norm = new_param(h, dtype=dtype, fill=1.0) if self.sandwich else None
        self.attn = attn
        self.mlp: GatedMLP | MoE
        if cfg.is_moe_layer(layer):
            assert cfg.moe is not None
            self.mlp = MoE(cfg.moe, h, cfg.hidden_act, dtype)
        else:
            self.mlp = GatedMLP(h, cfg.intermediate_size, cfg.hidden_act, dtype)
        # The GGUF blocks of the fused projections, when loaded with the stored weights.
        self.stored: dict[str, StoredWeight] = {}

    def prepare(self, backend: Backend) -> None:
        self.attn.prepare(backend, self.stored)
        self.mlp.prepare(backend, self.stored)

    def release(self, form: str) -> None:
        self.attn.release(form)
        self.mlp.release(form)

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        be = ctx.batch.backend
        h = be.norm(x, self.input_norm, self.eps)
        rotary, cos_sin = ctx.rope(self.layer)
        if self.attn_out_norm is None:
            x = self._attend(h, ctx, rotary, cos_sin, residual=x)
            h = be.norm(x, self.post_norm, self.eps)
            return self._mlp(h, ctx, residual=x)
        a = self._attend(h, ctx, rotary, cos_sin, residual=None)
        x = x + be.norm(a, self.attn_out_norm, self.eps)
        h = be.norm(x, self.post_norm, self.eps)
        assert self.mlp_out_norm is not None
        return x + be.norm(self._mlp(h, ctx, residual=None), self.mlp_out_norm, self.eps)

    def _mlp(self, h: torch.Tensor, ctx: StepContext, residual: torch.Tensor | None) -> torch.Tensor:
        lora = ctx.batch.lora
        if lora is not None and isinstance(self.mlp, GatedMLP):
            return self.mlp(h, ctx.batch.backend, residual=residual, lora=(lora, self.layer))
        return self.mlp(h, ctx.batch.backend, residual=residual)

    def forward_dp(self, x: torch.Tensor, ctx: StepContext, dp: DPLayout) -> torch.Tensor:
        """Data-parallel attention: attention (whole) over this rank's rows ``x``; the MLP (split
        over the group) over every rank's rows, gathered; this rank's rows of it added back."""
        be, tp = ctx.batch.backend, ctx.model.tp
        if x.shape[0]:
            h = be.norm(x, self.input_norm, self.eps)
            rotary, cos_sin = ctx.rope(self.layer)
            x = self._attend(h, ctx, rotary, cos_sin, residual=x)
            h = be.norm(x, self.post_norm, self.eps)
        else:  # no request of this rank's in the step: it still takes part in the MLP's collectives
            h = x
        if isinstance(self.mlp, MoE) and self.mlp.dispatch:  # expert parallel: tokens to their experts' ranks
            return x + self.mlp.dispatched(h, be)
        out = self.mlp(tp.gather_rows(h, dp.rows), be)
        lo, hi = dp.span(tp.rank)
        return x + out[lo:hi]

    def _attend(self, h: torch.Tensor, ctx: StepContext, rotary: RotaryEmbedding,
                cos_sin: tuple[torch.Tensor, torch.Tensor] | None, residual: torch.Tensor | None) -> torch.Tensor:
        if isinstance(self.attn, GQAttention):
            return self.attn(h, self.pool_layer, ctx.pool, ctx.batch, rotary, cos_sin, residual)
        assert cos_sin is not None and residual is not None
        return self.attn(h, self.pool_layer, ctx.pool, ctx.batch, cos_sin, residual)


class StepContext:
    """What every layer of one forward pass shares: the batch, the pool and the RoPE tables
    (computed once per rotary per pass)."""

    __slots__ = ("batch", "model", "pool", "tables")

    def __init__(self, model: LlamaForCausalLM, batch: ForwardBatch, pool: Any, dtype: torch.dtype) -> None:
        self.model, self.batch, self.pool = model, batch, pool
        self.tables: dict[int, tuple[torch.Tensor, torch.Tensor] | None] = {}

    def rope(self, layer: int) -> tuple[RotaryEmbedding, tuple[torch.Tensor, torch.Tensor] | None]:
        rotary = self.model.rotary_for(layer)
        key = id(rotary)
        if key not in self.tables:
            table = self.batch.rope_table
            if not self.batch.backend.wants_rope_rows:
                self.tables[key] = None
            elif table is not None:  # RoPE by row (M-RoPE), not by position
                dt = self.model.dtype
                self.tables[key] = (table[1].to(dt).unsqueeze(1), table[2].to(dt).unsqueeze(1))
            else:
                self.tables[key] = rotary.tables(self.batch.positions, self.model.dtype)
        return rotary, self.tables[key]


class LlamaForCausalLM(nn.Module):
    """Owns the weights; ``forward`` returns logits (float32) for ``batch.logits_idx``."""

    qkv_bias = False

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.cfg = cfg
        self.dtype = dtype
        self.device = device
        self.embed = new_param(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(self.make_layer(i) for i in range(cfg.num_layers))
        self.norm = new_param(cfg.hidden_size, dtype=dtype, fill=1.0)
        self.lm_head: torch.Tensor | None = None
        if not cfg.tie_word_embeddings:
            self.lm_head = new_param(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.rotary = RotaryEmbedding(self.rope_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings, device)
        self.local_rotary = (
            RotaryEmbedding(self.rope_dim, cfg.rope_local_theta, None, cfg.max_position_embeddings, device)
            if cfg.rope_local_theta is not None else None
        )
        self.head_ops: dict[str, Linear] = {}
        self.stored_head: StoredWeight | None = None
        self.embed_scale = torch.tensor(cfg.hidden_size**0.5, dtype=dtype) if cfg.embed_scale else None
        # Set by a proposer that reads the last layer's output (MTP): every forward then keeps it
        # in ``last_hidden`` ([T, H], before the final norm, all rows of the flat batch).
        self.capture_hidden = False
        self.last_hidden: torch.Tensor | None = None
        self.tp = SINGLE
        self.vocab_lo = 0  # the first token id of this rank's vocabulary slice
        self.pp = SINGLE_STAGE

    def keep_stage(self, pp: PipeStage) -> None:
        """Pipeline parallel: keep only this stage's layers (before loading, so only they are read);
        each keeps its global index (names, RoPE, windows) and gets its index in this stage's pool."""
        if pp.stages == 1:
            return
        lo, hi = pp.layers(self.cfg.num_layers)
        self.layers = nn.ModuleList(list(self.layers)[lo:hi])
        for i, layer in enumerate(self.layers):
            layer.pool_layer = i
        self.pp = pp

    def shard(self, tp: ParallelGroup, expert_parallel: bool = False) -> None:
        """Keep this rank's slice of every weight (``layers/parallel.py``): heads, MLP columns
        (or experts), and a vocabulary slice of the embedding and LM head (padded to equal rows).
        ``load_weights(..., tp=...)`` does the same layer by layer as it loads."""
        if tp.size == 1 or self.tp.size > 1:
            return
        for layer in self.layers:
            self.shard_layer(layer, tp, expert_parallel)
        self.shard_vocab(tp)

    def shard_layer(self, layer: DecoderLayer, tp: ParallelGroup, expert_parallel: bool) -> None:
        if self.has_stored_weights or self.fp8_weights:
            raise ValueError("tensor parallel runs dequantized weights (not --weights stored or fp8) for now")
        if tp.dp_attention:
            if self.cfg.mla is None:
                raise ValueError("--data-parallel-size runs the attention of MLA models (DeepSeek-V2/V3) data-parallel; "
                                 f"{self.cfg.architecture} has none: use --tensor-parallel-size or --replicas")
            if layer.attn_out_norm is not None:
                raise ValueError("data-parallel attention does not cover sandwich norms")
        else:
            layer.attn.shard(tp)
        if isinstance(layer.mlp, MoE):
            layer.mlp.shard(tp, expert_parallel)
        else:
            layer.mlp.shard(tp)

    def shard_vocab(self, tp: ParallelGroup) -> None:
        lo, hi, per = tp.padded_split(self.cfg.vocab_size)
        tied = self.lm_head is None or self.lm_head.data_ptr() == self.embed.data_ptr()
        self.embed = parameter(_pad_rows(self.embed.data[lo:hi], per))
        if self.lm_head is not None:
            self.lm_head = self.embed if tied else parameter(_pad_rows(self.lm_head.data[lo:hi], per))
        self.head_ops.clear()
        self.tp, self.vocab_lo = tp, lo

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings; vocabulary-parallel: each rank looks up its slice (zeros elsewhere), summed."""
        if self.tp.size == 1:
            return F.embedding(ids, self.embed)
        local = ids - self.vocab_lo
        outside = (local < 0) | (local >= self.embed.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.embed)
        return self.tp.reduce(x.masked_fill(outside.unsqueeze(1), 0.0))

    @property
    def rope_dim(self) -> int:
        return self.cfg.head_dim

    def make_layer(self, i: int) -> DecoderLayer:
        cfg = self.cfg
        return DecoderLayer(cfg, i, GQAttention(cfg, i, self.qkv_bias or cfg.attention_bias, self.dtype), self.dtype)

    def rotary_for(self, layer: int) -> RotaryEmbedding:
        if self.local_rotary is not None and self.cfg.is_sliding(layer):
            return self.local_rotary
        return self.rotary

    def prepare(self, backend: Backend) -> None:
        """Build every projection in ``backend``'s layout (kept under ``backend.form``). Several
        may coexist: engines sharing one loaded model may run different backends, and a runner
        moves from torch's ops to the kernels when they finish building."""
        for layer in self.layers:
            layer.prepare(backend)
        if backend.form not in self.head_ops:
            head = self.embed if self.lm_head is None else self.lm_head
            self.head_ops[backend.form] = backend.linear(head, None, stored=self.stored_head)

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

    def release(self, form: str) -> None:
        """Forget a form's packed weights (the runner moved on from it: memory back)."""
        for layer in self.layers:
            layer.release(form)
        self.head_ops.pop(form, None)

    def release_dense_stored(self, form: str) -> int:
        """After the ``stored`` form ``form`` is built: keep one copy of each projection it runs as stored
        codes — the kernels' packed blocks, which ``layer.stored`` (a MoE's experts: ``MoE.release_dense``)
        then holds too, so the form is rebuilt without repacking — and drop the dense weight and the unpacked
        blocks. Returns the bytes given back; the head is left as it is (a tied head is the embedding).
        NOTE: afterwards only a stored form runs these projections (another backend's ``prepare`` refuses)."""
        freed = 0
        for layer in self.layers:
            freed += layer.mlp.release_dense(form) if isinstance(layer.mlp, MoE) else 0
            freed += release_sites(layer.stored, self.stored_sites(layer, form))
        return freed

    def stored_sites(self, layer: Any, form: str) -> Iterator[tuple[str, nn.Parameter, Any]]:
        """``(key in layer.stored, dense weight, form's linear)`` of each projection of ``layer`` that
        may run as stored codes (``release_dense_stored``); a family with other layers names its own."""
        for key, mod, attr, idx in (("qkv", layer.attn, "qkv", 0), ("o", layer.attn, "o", 1),
                                    ("gate_up", layer.mlp, "gate_up", 0), ("down", layer.mlp, "down", 1)):
            ops = getattr(mod, "ops", {}).get(form)
            if key in layer.stored and ops is not None:
                yield key, getattr(mod, attr), ops[idx]

    @property
    def has_stored_weights(self) -> bool:
        return self.stored_head is not None or any(layer.stored or getattr(layer.mlp, "has_stored", False) for layer in self.layers)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, pool: Any) -> torch.Tensor:
        if batch.dp is not None:
            return self._forward_dp(batch, pool, batch.dp)
        return self._forward_stages([batch, *batch.micro], pool)

    def _forward_stages(self, batches: list[ForwardBatch], pool: Any) -> torch.Tensor:
        """This stage's layers over the step's micro-batches (one, without pipeline parallel):
        stage 0 embeds, a later stage receives the previous one's hidden states; a stage posts its
        sends (not awaited) and goes on with the next micro-batch while the following stage runs this
        one; the last stage computes the logits, which stage 0 collects at the end, in order."""
        pp, sent, out = self.pp, [], []
        for b in batches:
            if pp.first:
                x = self.embed_tokens(b.input_ids)
                if self.embed_scale is not None:
                    x = x * self.embed_scale
                if b.images is not None:  # image features over their placeholders (after Gemma's scale, as HF)
                    x = b.images.splice(x)
            else:
                x = pp.receive((b.input_ids.numel(), self.cfg.hidden_size), self.dtype, self.device, pp.stage - 1)
            ctx = StepContext(self, b, pool, x.dtype)
            for layer in self.layers:
                x = layer(x, ctx)
            if not pp.last:
                x = x.contiguous()
                sent.append((pp.post(x, pp.stage + 1), x))
                continue
            logits = self._logits(x, b)
            if pp.first:
                out.append(logits)
            else:
                sent.append((pp.post(logits, 0), logits))
        if pp.first and not pp.last:
            for b in batches:
                rows = b.input_ids.numel() if b.logits_idx is None else b.logits_idx.numel()
                out.append(pp.receive((rows, self.cfg.vocab_size), torch.float32, self.device, pp.stages - 1))
        for work, _ in sent:
            work.wait()
        if not out:
            return x  # a later stage's return value is not used
        return out[0] if len(out) == 1 else torch.cat(out)

    def _forward_dp(self, batch: ForwardBatch, pool: Any, dp: DPLayout) -> torch.Tensor:
        """Data-parallel attention: this rank's rows through every layer (``DecoderLayer.forward_dp``);
        the embedding and the head, split over the vocabulary, see every rank's tokens. Every rank
        returns the logits of the whole group's sampling rows (rank 0's first)."""
        tp = self.tp
        lo, hi = dp.span(tp.rank)
        x = self.embed_tokens(dp.ids)[lo:hi]
        ctx = StepContext(self, batch, pool, x.dtype)
        for layer in self.layers:
            x = layer.forward_dp(x, ctx, dp)
        x = x if batch.logits_idx is None else x.index_select(0, batch.logits_idx)
        if x.shape[0]:
            x = batch.backend.norm(x, self.norm, self.cfg.rms_norm_eps)
        x = tp.gather_rows(x, dp.samples)
        return tp.gather_columns(self.head_ops[batch.backend.form](x).float(), self.cfg.vocab_size)

    def _logits(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        if self.capture_hidden:
            self.last_hidden = x
        if batch.logits_idx is not None:
            if not batch.logits_idx.numel():  # NOTE: nothing samples (a non-final prefill chunk): no head, on every TP rank
                return x.new_empty((0, self.cfg.vocab_size), dtype=torch.float32)
            x = x.index_select(0, batch.logits_idx)
        x = batch.backend.norm(x, self.norm, self.cfg.rms_norm_eps)
        logits = self.tp.gather_columns(self.head_ops[batch.backend.form](x).float(), self.cfg.vocab_size)
        if (cap := self.cfg.final_softcap) is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    # ------------------------------------------------------------------ weights
    def load_stored(self, stored: Mapping[str, StoredWeight]) -> None:
        """Keep the stored blocks of the projections (HF names, rows in HF order) for the ``stored`` form; a fused
        one (QKV, gate/up) only when every part is stored in one type (else it runs dequantized); MoE: ``MoE.load_stored``."""

        def fuse(names: list[str]) -> StoredWeight | None:
            return fuse_rows([stored.get(n) for n in names])

        for layer in self.layers:
            i = layer.layer
            a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
            found = {
                "qkv": fuse([a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"]),
                "o": fuse([a + "o_proj.weight"]),
                "gate_up": fuse([m + "gate_proj.weight", m + "up_proj.weight"]),
                "down": fuse([m + "down_proj.weight"]),
            }
            layer.stored = {k: v for k, v in found.items() if v is not None}
            if isinstance(layer.mlp, MoE):
                layer.mlp.load_stored(stored, i)
        tied = self.lm_head is None or self.lm_head.data_ptr() == self.embed.data_ptr()
        self.stored_head = fuse(["model.embed_tokens.weight" if tied else "lm_head.weight"])

    def load_weights(self, weights: Mapping[str, torch.Tensor], fp8_block: tuple[int, int] | None = None,
                     tp: ParallelGroup = SINGLE, expert_parallel: bool = False) -> None:
        """Load HF-named tensors (``model.layers.N.self_attn.q_proj.weight`` …), fusing Q/K/V
        and gate/up. Every parameter must be covered; a missing one is an error, not zeros.
        ``fp8_block``: the checkpoint's FP8 weights stay FP8 (w8a16; ``--weights fp8``). ``tp``:
        keep only this rank's slices, each layer sharded as soon as it is loaded (with lazily read
        ``weights``, a rank never holds more than one layer's full tensors)."""
        src = WeightSource(weights, self.dtype, self.device, fp8_block)
        get = src.get
        offset = self.cfg.norm_offset
        self.embed.data = get("model.embed_tokens.weight").contiguous()
        self.norm.data = norm_weight(get("model.norm.weight"), offset)
        if self.lm_head is not None:
            if src.has("lm_head.weight"):
                self.lm_head.data = get("lm_head.weight").contiguous()
            else:  # some checkpoints tie without saying so
                self.lm_head.data = self.embed.data
        for layer in self.layers:
            p = f"model.layers.{layer.layer}."
            layer.input_norm.data = norm_weight(get(p + "input_layernorm.weight"), offset)
            if layer.attn_out_norm is not None and layer.mlp_out_norm is not None:
                layer.attn_out_norm.data = norm_weight(get(p + "post_attention_layernorm.weight"), offset)
                layer.post_norm.data = norm_weight(get(p + "pre_feedforward_layernorm.weight"), offset)
                layer.mlp_out_norm.data = norm_weight(get(p + "post_feedforward_layernorm.weight"), offset)
            else:
                layer.post_norm.data = norm_weight(get(p + "post_attention_layernorm.weight"), offset)
            self.load_attention(layer, src, p)
            self.load_mlp(layer, src, p)
            if tp.size > 1:
                self.shard_layer(layer, tp, expert_parallel)
        if tp.size > 1:
            self.shard_vocab(tp)

    def load_attention(self, layer: DecoderLayer, src: WeightSource, p: str) -> None:
        assert isinstance(layer.attn, GQAttention)
        layer.attn.load(src, p + "self_attn.", self.cfg.norm_offset)

    def load_mlp(self, layer: DecoderLayer, src: WeightSource, p: str) -> None:
        mlp = layer.mlp
        if isinstance(mlp, GatedMLP):
            mlp.load(src, p + "mlp.")
            return
        if src.has(p + "mlp.router.weight"):  # gpt-oss: a biased router, interleaved stacked experts
            mlp.router.data = src.get_f32(p + "mlp.router.weight")
            if mlp.router_bias is not None:
                mlp.router_bias.data = src.get_f32(p + "mlp.router.bias")
            mlp.experts.load_interleaved(src, p + "mlp.experts.")
            return
        if src.has(p + "block_sparse_moe.gate.weight"):  # Mixtral's names
            m, names = p + "block_sparse_moe.", ("w1", "w3", "w2")
        else:
            m, names = p + "mlp.", ("gate_proj", "up_proj", "down_proj")
        mlp.router.data = src.get_f32(m + "gate.weight")
        if mlp.bias is not None:
            mlp.bias.data = src.get_f32(m + "gate.e_score_correction_bias")
        mlp.experts.load(src, m + "experts.", names)
        if mlp.shared is not None:
            shared = m + ("shared_expert." if src.has(m + "shared_expert.gate_proj.weight") else "shared_experts.")
            mlp.shared.load(src, shared)
        if mlp.shared_gate is not None:
            mlp.shared_gate.data = src.get(m + "shared_expert_gate.weight")

    @property
    def fp8_weights(self) -> int:
        """How many weights are kept in FP8 (``--weights fp8``)."""
        return sum(len(getattr(m, "fp8", {})) for m in self.modules())


def _pad_rows(w: torch.Tensor, n: int) -> torch.Tensor:
    """``w`` with zero rows appended up to ``n`` rows (every rank's vocabulary slice is as wide)."""
    if w.shape[0] == n:
        return w.contiguous()
    return torch.cat([w, w.new_zeros(n - w.shape[0], *w.shape[1:])])


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: Llama with biases on the Q/K/V projections."""

    qkv_bias = True
