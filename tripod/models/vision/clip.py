"""CLIP's vision tower (``CLIPVisionModel``): patch convolution, a class token, learned positions,
a LayerNorm before the encoder (``pre_layrnorm``), the pre-norm ViT layers (``vit.py``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tripod.layers.weights import WeightSource
from tripod.models.vision.vit import LayerNormParams, VitEncoder, frozen


class ClipVisionTower(nn.Module):
    """Pixels ``[B, 3, S, S]`` → the encoder's hidden states (``[B, 1 + patches, H]`` each, the class
    token first). Fixed resolution: ``image_size`` square images only (the processor crops)."""

    has_class_token = True

    def __init__(self, cfg: dict[str, Any], dtype: torch.dtype) -> None:
        super().__init__()
        h = int(cfg["hidden_size"])
        self.patch, self.image_size = int(cfg["patch_size"]), int(cfg["image_size"])
        self.channels = int(cfg.get("num_channels", 3))
        self.patches = (self.image_size // self.patch) ** 2
        self.patch_weight = frozen(h, self.channels, self.patch, self.patch, dtype=dtype)
        self.class_embedding = frozen(h, dtype=dtype)
        self.positions = frozen(self.patches + 1, h, dtype=dtype)
        self.pre_norm = LayerNormParams(h, float(cfg.get("layer_norm_eps", 1e-5)), dtype)
        self.encoder = VitEncoder(cfg, dtype)

    @property
    def pixel_shape(self) -> tuple[int, int, int]:
        return (self.channels, self.image_size, self.image_size)

    def load(self, src: WeightSource, p: str) -> None:
        if src.has(p + "vision_model.embeddings.patch_embedding.weight"):  # transformers 4's names
            p += "vision_model."
        self.patch_weight.data = src.get(p + "embeddings.patch_embedding.weight").contiguous()
        self.class_embedding.data = src.get(p + "embeddings.class_embedding")
        self.positions.data = src.get(p + "embeddings.position_embedding.weight").contiguous()
        self.pre_norm.load(src, p + "pre_layrnorm")
        self.encoder.load(src, p)

    def forward(self, pixels: torch.Tensor, depth: int | None = None) -> list[torch.Tensor]:
        x = F.conv2d(pixels.to(self.patch_weight.dtype), self.patch_weight, stride=self.patch)
        x = x.flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(x.shape[0], 1, -1)
        x = torch.cat([cls, x], dim=1) + self.positions
        return self.encoder(self.pre_norm(x), depth)
