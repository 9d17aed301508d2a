"""Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``): the windowed vision tower
(``vision/qwen2_5_vl_vision.py``) and a Qwen2 decoder whose RoPE is multimodal (``MRope``: a
(t, h, w) position per token; the engine builds a request's positions once from its images' grids,
``mrope_positions``, and hands each step its rows' cos/sin as ``ForwardBatch.rope_table``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tripod.layers.weights import WeightSource
from tripod.models.config import ModelConfig
from tripod.models.multimodal import MRope, VisionLanguageModel, mrope_positions
from tripod.models.vision.qwen2_5_vl_vision import QwenVisionTower


class Qwen2_5_VLForConditionalGeneration(VisionLanguageModel):
    """The Qwen2 decoder with M-RoPE plus the vision tower (``visual.*``)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(cfg, dtype, device)
        if cfg.rope_scaling:
            raise ValueError(f"Qwen2.5-VL with rope scaling {cfg.rope_scaling} is not supported")
        assert self.vision.mrope_section is not None
        self.tower = QwenVisionTower(self.vision.tower, dtype).to(device)
        self.merge = self.tower.merge
        self.mrope = MRope(cfg.head_dim, cfg.rope_theta, self.vision.mrope_section, device)

    def load_vision(self, src: WeightSource) -> None:
        self.tower.load(src, "visual.")

    def image_tokens(self, shape: Sequence[int], grid_thw: Sequence[int] | None) -> int:
        tower = self.tower
        if grid_thw is None or len(grid_thw) != 3:
            raise ValueError("a Qwen2.5-VL image needs its (t, h, w) patch grid (grid_thw)")
        t, h, w = (int(v) for v in grid_thw)
        if h % self.merge or w % self.merge:
            raise ValueError(f"a Qwen2.5-VL image's grid {list(grid_thw)} must be a multiple of {self.merge} in h and w")
        if tuple(shape) != (t * h * w, tower.patch_dim):
            raise ValueError(f"pixels of shape {list(shape)} do not match the grid {list(grid_thw)}: "
                             f"[{t * h * w}, {tower.patch_dim}] expected; process images with the model's processor")
        return t * h * w // (self.merge * self.merge)

    def rope_positions(self, prompt_len: int, images: Sequence[tuple[int, int, Sequence[int] | None]]
                       ) -> tuple[torch.Tensor, int] | None:
        spans = [(offset, length, grid) for offset, length, grid in images if grid is not None]
        assert len(spans) == len(images), "validated: every image has its grid"
        return mrope_positions(prompt_len, spans, self.merge)

    def encode(self, pixels: list[torch.Tensor], grids: list[list[int] | None]) -> list[torch.Tensor]:
        sizes = [int(g[0] * g[1] * g[2]) // (self.merge * self.merge) for g in grids if g is not None]
        assert len(sizes) == len(pixels)
        feats = self.tower(torch.cat(pixels).to(self.device), [list(g) for g in grids if g is not None])
        return list(feats.split(sizes))
