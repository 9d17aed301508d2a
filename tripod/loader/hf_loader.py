"""Read a local HF-format folder: config.json, *.safetensors, tokenizer files. No hub."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from tripod.models.config import ModelConfig


class HFFolder:
    """A local checkpoint folder in Hugging Face layout."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        cfg = self.path / "config.json"
        if not cfg.is_file():
            raise ValueError(f"{self.path} is not a model folder: config.json is missing")
        self.raw_config: dict[str, Any] = json.loads(cfg.read_text())
        self.files = sorted(self.path.glob("*.safetensors"))
        if not self.files:
            raise ValueError(
                f"{self.path} has no *.safetensors files (tripod loads safetensors or GGUF only)"
            )

    def config(self) -> ModelConfig:
        cfg = ModelConfig.from_hf_dict(self.raw_config)
        if not cfg.eos_token_ids:
            gen = self.path / "generation_config.json"
            if gen.is_file():
                eos = json.loads(gen.read_text()).get("eos_token_id")
                if eos is not None:
                    ids = tuple(eos) if isinstance(eos, list) else (eos,)
                    cfg = _replace(cfg, eos_token_ids=tuple(int(e) for e in ids))
        return cfg

    @property
    def quantization(self) -> str:
        q = self.raw_config.get("quantization_config")
        if q:
            raise ValueError(
                f"quantized checkpoints ({q.get('quant_method', q)}) are not supported yet; "
                "use an unquantized folder or a GGUF file"
            )
        return str(self.raw_config.get("torch_dtype") or self.raw_config.get("dtype") or "none")

    def weights(self) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        out: dict[str, torch.Tensor] = {}
        for f in self.files:
            out.update(load_file(str(f)))
        return out

    def tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(self.path), local_files_only=True)


def _replace(cfg: ModelConfig, **kw: Any) -> ModelConfig:
    import dataclasses

    return dataclasses.replace(cfg, **kw)
