"""Random PEFT LoRA adapters of the tiny models, made with ``peft`` at test time (no download)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

ADAPTERS = {
    "attn": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "mlp": dict(r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"]),
    "all-rs": dict(r=16, lora_alpha=8, use_rslora=True,
                   target_modules=["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
}


def make_adapter(base: Any, kind: str, folder: Path, seed: int) -> Any:
    """Save a random PEFT LoRA adapter of ``base``; returns the adapted transformers model."""
    import copy

    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    peft_model = get_peft_model(copy.deepcopy(base), LoraConfig(init_lora_weights=False, lora_dropout=0.0, **ADAPTERS[kind]))
    with torch.no_grad():  # decisive deltas: B away from zero
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape) * 0.5 / p.shape[1] ** 0.5)
    peft_model.save_pretrained(str(folder))
    return peft_model.eval().base_model.model  # the HF model with the adapter injected (not merged)


def other_llama() -> Any:
    """A tiny Llama 48 wide (the tiny models are 64): adapters made for it fit none of them."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.support.tiny_models import COMMON

    cfg = AutoConfig.for_model("llama", **{**COMMON, "hidden_size": 48, "head_dim": 12})
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()




def random_adapter(folder: Path, cfg: Any, rank: int, seed: int, scale: float = 0.05,
                   modules: tuple[str, ...] | None = None) -> Path:
    """Write a random PEFT LoRA folder for a tripod ``ModelConfig`` (``modules``, default every
    projection, of every layer), without transformers or peft: for models held only as GGUF (the
    embedded SmolLM2)."""
    import json

    from safetensors.torch import save_file

    from tripod.layers.lora import MODULE_SITES, site_shapes

    names = [n for n in MODULE_SITES if modules is None or n in modules]
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    shapes = site_shapes(cfg)
    for layer in range(cfg.num_layers):
        for name in names:
            site, part = MODULE_SITES[name]
            d_in, d_out = shapes[site][part]
            key = f"base_model.model.model.layers.{layer}.{'self_attn' if site in ('qkv', 'o') else 'mlp'}.{name}"
            tensors[key + ".lora_A.weight"] = torch.randn(rank, d_in, generator=g) / d_in**0.5
            tensors[key + ".lora_B.weight"] = torch.randn(d_out, rank, generator=g) * scale
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
        "target_modules": names}))
    return folder
