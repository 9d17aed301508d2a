"""DeepSeek-V2/V3: multi-head latent attention over a latent KV pool, fine-grained MoE with shared
experts (dense MLPs in the first ``first_k_dense_replace`` layers), V2's softmax and V3's sigmoid
routing with group-limited choice, and V3's multi-token-prediction (MTP) module when the
checkpoint carries it (``models/mtp.py``)."""

from __future__ import annotations

from tripod.layers.mla import MLAttention
from tripod.layers.weights import WeightSource
from tripod.models.llama import DecoderLayer, LlamaForCausalLM


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

    def load_attention(self, layer: DecoderLayer, src: WeightSource, p: str) -> None:
        assert isinstance(layer.attn, MLAttention)
        layer.attn.load(src, p + "self_attn.")
