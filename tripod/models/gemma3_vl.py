"""Gemma 3's vision-language model (``Gemma3ForConditionalGeneration``): a SigLIP tower, its patch
grid average-pooled to ``mm_tokens_per_image`` soft tokens, Gemma's (1 + w) RMSNorm and a
projection matrix into the Gemma 3 decoder. The decoder's attention lets an image's tokens see
each other both ways (``bidirectional_images``: transformers' ``token_type_ids`` mask), in its
sliding-window layers within the window; the engine computes each image in one prefill chunk."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from tripod.layers.weights import WeightSource
from tripod.models.config import ModelConfig
from tripod.models.gqa import norm_weight
from tripod.models.multimodal import VisionLanguageModel
from tripod.models.vision.siglip import SiglipVisionTower
from tripod.models.vision.vit import frozen


class Gemma3ForConditionalGeneration(VisionLanguageModel):
    """The Gemma 3 decoder plus its tower and the soft-token projector."""

    bidirectional_images = True

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(cfg, dtype, device)
        spec = self.vision
        if spec.tower.get("model_type", "siglip_vision_model") != "siglip_vision_model":
            raise ValueError("Gemma 3's vision tower must be SigLIP")
        self.tower = SiglipVisionTower(spec.tower, dtype).to(device)
        side = self.tower.image_size // self.tower.patch
        per_side = round(spec.tokens_per_image**0.5)
        if per_side * per_side != spec.tokens_per_image or side % per_side:
            raise ValueError(f"mm_tokens_per_image {spec.tokens_per_image} must be a square dividing the "
                             f"{side}x{side} patch grid")
        self.pool, self.side = side // per_side, side
        vh = int(spec.tower["hidden_size"])
        self.soft_eps = float(spec.tower.get("layer_norm_eps", 1e-6))
        self.soft_norm = frozen(vh, dtype=torch.float32)  # (1 + w), kept in float32 as HF computes it
        self.projection = frozen(vh, cfg.hidden_size, dtype=dtype)

    def load_vision(self, src: WeightSource) -> None:
        self.tower.load(src, "vision_tower.")
        self.soft_norm.data = norm_weight(src.get_f32("multi_modal_projector.mm_soft_emb_norm.weight"), True)
        self.projection.data = src.get("multi_modal_projector.mm_input_projection_weight").contiguous()

    def image_tokens(self, shape: Sequence[int], grid_thw: Sequence[int] | None) -> int:
        want = self.tower.pixel_shape
        if grid_thw is not None or tuple(shape) != want:
            raise ValueError(f"this model's vision tower takes pixels of shape {list(want)} (got {list(shape)}); "
                             "process images with its own processor")
        return self.vision.tokens_per_image

    def encode(self, pixels: list[torch.Tensor], grids: list[list[int] | None]) -> list[torch.Tensor]:
        tower = self.tower
        x = tower.post_norm(tower(torch.stack(pixels).to(self.device))[-1])  # [B, patches, vh]
        b, _, vh = x.shape
        grid = x.transpose(1, 2).reshape(b, vh, self.side, self.side)
        pooled = F.avg_pool2d(grid, self.pool, self.pool).flatten(2).transpose(1, 2)
        h = pooled.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.soft_eps) * self.soft_norm
        feats = torch.matmul(h.to(pooled.dtype), self.projection)
        return list(feats.unbind(0))
