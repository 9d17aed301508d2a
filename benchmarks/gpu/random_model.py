"""Random-weight models of real shapes, made on the device in seconds (no checkpoint to read):
the HF config of the architecture, the parameter shapes from transformers' model built on the
meta device, and each tensor drawn straight on the device when tripod's loader asks for it (a
layer's weights at a time; nothing on the host)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

import torch

LLAMA_8B: dict[str, Any] = dict(
    model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=4096,
    intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
    max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
    tie_word_embeddings=False,
)
DEEPSEEK_V2_LITE: dict[str, Any] = dict(
    model_type="deepseek_v2", architectures=["DeepseekV2ForCausalLM"], vocab_size=102400, hidden_size=2048,
    intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16,
    num_key_value_heads=16, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6, first_k_dense_replace=1,
    kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    topk_method="greedy", n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=False,
    max_position_embeddings=8192, rope_theta=10000.0, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
    tie_word_embeddings=False,
)
# The same structures at toy sizes: the dry run (CPU, Triton's interpreter).
TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, vocab_size=256, max_position_embeddings=512)
TINY_LLAMA = {**LLAMA_8B, **TINY, "num_attention_heads": 4, "num_key_value_heads": 2}
TINY_DEEPSEEK = {**DEEPSEEK_V2_LITE, **TINY, "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 8,
                 "num_experts_per_tok": 2, "moe_intermediate_size": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16,
                 "qk_rope_head_dim": 16, "v_head_dim": 16, "n_shared_experts": 1}


class RandomWeights(Mapping[str, torch.Tensor]):
    """HF-named tensors drawn on ``device`` on access: projections with unit-variance outputs,
    norms near 1."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype, device: torch.device, seed: int) -> None:
        self.shapes, self.dtype, self.device = shapes, dtype, device
        self.gen = torch.Generator(device=device).manual_seed(seed)

    def __getitem__(self, name: str) -> torch.Tensor:
        shape = self.shapes[name]
        if len(shape) == 1:
            return 1.0 + 0.05 * torch.randn(shape, generator=self.gen, device=self.device, dtype=self.dtype)
        std = 1.0 if "embed" in name else 1.0 / math.sqrt(shape[-1])
        return torch.randn(shape, generator=self.gen, device=self.device, dtype=self.dtype) * std

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


def parameter_count(hf: dict[str, Any]) -> int:
    return sum(math.prod(s) for s in _shapes(hf).values())


def _shapes(hf: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(hf["model_type"], **{k: v for k, v in hf.items() if k != "model_type"})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    out = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    for n, b in model.named_buffers():  # (DeepSeek's correction bias and other non-persistent buffers)
        out.setdefault(n, tuple(b.shape))
    return out


def random_model(hf: dict[str, Any], dtype: torch.dtype, device: torch.device, seed: int = 0) -> Any:
    """A ``LoadedModel`` of the architecture ``hf`` (an HF config dict) with random weights."""
    from tripod.loader import LoadedModel, load_tokenizer
    from tripod.models.config import ModelConfig
    from tripod.models.registry import model_class

    cfg = ModelConfig.from_hf_dict(hf)
    net = model_class(cfg.architecture)(cfg, dtype, device)
    net.load_weights(RandomWeights(_shapes(hf), dtype, device, seed))
    net.eval()
    return LoadedModel(f"random {hf['architectures'][0]}", "(random weights)", cfg, net, load_tokenizer(None).tokenizer,
                       "random", dtype)
