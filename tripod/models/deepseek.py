"""DeepSeek-V2/V3: multi-head latent attention over a latent KV pool, fine-grained MoE with shared
experts (dense MLPs in the first ``first_k_dense_replace`` layers), V2's softmax and V3's sigmoid
routing with group-limited choice, and V3's multi-token-prediction (MTP) module when the
checkpoint carries it (``engine/speculative/mtp.py``)."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from tripod.layers.batch import ForwardBatch
from tripod.layers.mla import MLAttention
from tripod.layers.norm import rms_norm
from tripod.layers.parallel import SINGLE, ParallelGroup
from tripod.layers.weights import WeightSource
from tripod.memory.kv_pool import LatentPool, PoolSpec
from tripod.models.config import ModelConfig
from tripod.models.llama import DecoderLayer, LlamaForCausalLM, StepContext


class DeepseekForCausalLM(LlamaForCausalLM):
    """DeepSeek-V2 and V3 (``DeepseekV2ForCausalLM``, ``DeepseekV3ForCausalLM``)."""

    @property
    def rope_dim(self) -> int:
        assert self.cfg.mla is not None
        return self.cfg.mla.qk_rope_head_dim

    def make_layer(self, i: int) -> DecoderLayer:
        cfg = self.cfg
        if cfg.mla is None:
            raise ValueError(f"{cfg.architecture} needs kv_lora_rank and the MLA dimensions in its config")
        attn = MLAttention(cfg.mla, cfg.hidden_size, cfg.num_heads, cfg.rms_norm_eps, cfg.attn_scale,
                           cfg.attention_bias, self.dtype)
        return DecoderLayer(cfg, i, attn, self.dtype)

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(cfg, dtype, device)
        self.mtp: MTPModule | None = None

    def load_weights(self, weights: Mapping[str, torch.Tensor], fp8_block: tuple[int, int] | None = None,
                     tp: ParallelGroup = SINGLE, expert_parallel: bool = False) -> None:
        super().load_weights(weights, fp8_block, tp, expert_parallel)
        index = self.cfg.num_layers
        # (a sharded model runs no MTP draft: --speculative mtp is refused with tensor parallel)
        if tp.size == 1 and self.cfg.num_nextn_predict_layers and f"model.layers.{index}.eh_proj.weight" in weights:
            self.mtp = MTPModule(self)
            self.mtp.load(WeightSource(weights, self.dtype, self.device, fp8_block), self)

    def load_attention(self, layer: DecoderLayer, src: WeightSource, p: str) -> None:
        assert isinstance(layer.attn, MLAttention)
        layer.attn.load(src, p + "self_attn.")


class MTPModule(torch.nn.Module):
    """DeepSeek-V3's multi-token-prediction module (``model.layers.{num_hidden_layers}.*``).

    Given the target's last hidden state at position i (before the final norm) and the embedding
    of token i + 1, it predicts token i + 2: ``eh_proj([enorm(embed(t[i+1])); hnorm(h[i])])``
    through one more decoder layer (MLA + MoE, its own one-layer latent pool), then
    ``shared_head.norm`` and ``shared_head.head``. Its output hidden state can feed it again
    (chained drafts). Loaded when the checkpoint carries it; the main forward never runs it.
    """

    def __init__(self, target: DeepseekForCausalLM) -> None:
        super().__init__()
        cfg, dtype = target.cfg, target.dtype
        h = cfg.hidden_size
        self.eps = cfg.rms_norm_eps
        self.index = cfg.num_layers  # its tensors' layer index in the checkpoint
        self.enorm = _param(h, dtype)
        self.hnorm = _param(h, dtype)
        self.eh_proj = _param(h, 2 * h, dtype)
        self.layer = target.make_layer(self.index)
        self.layer.layer = self.layer.pool_layer = 0  # its own one-layer pool (and RoPE: DeepSeek has one table)
        self.head_norm = _param(h, dtype)
        self.head = _param(cfg.vocab_size, h, dtype)

    def load(self, src: WeightSource, target: DeepseekForCausalLM) -> None:
        p = f"model.layers.{self.index}."
        self.enorm.data = src.get(p + "enorm.weight")
        self.hnorm.data = src.get(p + "hnorm.weight")
        self.eh_proj.data = src.get(p + "eh_proj.weight").contiguous()
        self.layer.input_norm.data = src.get(p + "input_layernorm.weight")
        self.layer.post_norm.data = src.get(p + "post_attention_layernorm.weight")
        target.load_attention(self.layer, src, p)
        target.load_mlp(self.layer, src, p)
        self.head_norm.data = src.get(p + "shared_head.norm.weight")
        name = p + "shared_head.head.weight"
        head = target.lm_head if target.lm_head is not None else target.embed
        self.head.data = src.get(name).contiguous() if src.has(name) else head.data

    @staticmethod
    def pool_spec(cfg: ModelConfig) -> PoolSpec:
        """Its own pool: one layer of latents, at the target's slot ids."""
        assert cfg.mla is not None
        return PoolSpec(1, "latent", latent_dim=cfg.mla.pool_dim)

    @torch.inference_mode()
    def forward(self, target: DeepseekForCausalLM, batch: ForwardBatch, hidden: torch.Tensor,
                pool: LatentPool) -> tuple[torch.Tensor, torch.Tensor]:
        """``batch.input_ids`` are the tokens t[i+1], ``hidden`` ``[T, H]`` the hidden states
        h[i] → (float32 logits for ``batch.logits_idx`` (all rows when None), the module's own
        hidden states ``[T, H]`` for a chained step)."""
        self.layer.prepare(batch.backend)
        e = rms_norm(F.embedding(batch.input_ids, target.embed), self.enorm, self.eps)
        x = F.linear(torch.cat((e, rms_norm(hidden, self.hnorm, self.eps)), dim=-1), self.eh_proj)
        x = self.layer(x, StepContext(target, batch, pool, x.dtype))
        rows = x if batch.logits_idx is None else x.index_select(0, batch.logits_idx)
        return F.linear(rms_norm(rows, self.head_norm, self.eps), self.head).float(), x


def _param(*dims: int | torch.dtype) -> torch.nn.Parameter:
    *shape, dtype = dims
    assert isinstance(dtype, torch.dtype)
    return torch.nn.Parameter(torch.ones(*(int(d) for d in shape), dtype=dtype), requires_grad=False)
