"""SigLIP's vision tower (``SiglipVisionModel``): patch convolution with a bias, learned positions,
the pre-norm ViT layers (``vit.py``) and a final LayerNorm (``post_layernorm``, which Gemma 3's
features go through; LLaVA reads the encoder's hidden states before it). Its attention-pooling head
is not used by either."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tripod.layers.weights import WeightSource
from tripod.models.vision.vit import LayerNormParams, VitEncoder, frozen


class SiglipVisionTower(nn.Module):
    """Pixels ``[B, 3, S, S]`` → the encoder's hidden states (``[B, patches, H]`` each);
    ``post_norm`` gives the tower's last hidden state. Fixed resolution (``image_size``)."""

    has_class_token = False

    def __init__(self, cfg: dict[str, Any], dtype: torch.dtype) -> None:
        super().__init__()
        h = int(cfg["hidden_size"])
        self.patch, self.image_size = int(cfg["patch_size"]), int(cfg["image_size"])
        self.channels = int(cfg.get("num_channels", 3))
        self.patches = (self.image_size // self.patch) ** 2
        self.patch_weight = frozen(h, self.channels, self.patch, self.patch, dtype=dtype)
        self.patch_bias = frozen(h, dtype=dtype)
        self.positions = frozen(self.patches, h, dtype=dtype)
        self.encoder = VitEncoder(cfg, dtype)
        self.post_norm = LayerNormParams(h, float(cfg.get("layer_norm_eps", 1e-6)), dtype)

    @property
    def pixel_shape(self) -> tuple[int, int, int]:
        return (self.channels, self.image_size, self.image_size)

    def load(self, src: WeightSource, p: str) -> None:
        if src.has(p + "vision_model.embeddings.patch_embedding.weight"):  # transformers 4's names
            p += "vision_model."
        self.patch_weight.data = src.get(p + "embeddings.patch_embedding.weight").contiguous()
        self.patch_bias.data = src.get(p + "embeddings.patch_embedding.bias")
        self.positions.data = src.get(p + "embeddings.position_embedding.weight").contiguous()
        self.encoder.load(src, p)
        self.post_norm.load(src, p + "post_layernorm")

    def forward(self, pixels: torch.Tensor, depth: int | None = None) -> list[torch.Tensor]:
        x = F.conv2d(pixels.to(self.patch_weight.dtype), self.patch_weight, self.patch_bias, stride=self.patch)
        x = x.flatten(2).transpose(1, 2) + self.positions
        return self.encoder(x, depth)
