"""LLaVA-style models (``LlavaForConditionalGeneration``): a CLIP or SigLIP tower, hidden states of
``vision_feature_layer`` (one layer, or several concatenated), the class token dropped under the
"default" selection, and a two-layer projector (linear → activation → linear) into any decoder
tripod runs (Llama, Mistral, Qwen2 … as the text config says)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tripod.layers.weights import WeightSource
from tripod.models.config import ModelConfig
from tripod.models.multimodal import VisionLanguageModel
from tripod.models.vision.clip import ClipVisionTower
from tripod.models.vision.siglip import SiglipVisionTower
from tripod.models.vision.vit import LinearParams, activation

TOWERS = {"clip_vision_model": ClipVisionTower, "siglip_vision_model": SiglipVisionTower}


class LlavaForConditionalGeneration(VisionLanguageModel):
    """The decoder plus its tower (``vision_tower.*``) and projector (``multi_modal_projector.*``)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(cfg, dtype, device)
        spec = self.vision
        kind = str(spec.tower.get("model_type", "clip_vision_model"))
        if kind not in TOWERS:
            raise ValueError(f"LLaVA vision tower {kind!r} is not supported; supported: {', '.join(TOWERS)}")
        if spec.feature_select not in ("default", "full"):
            raise ValueError(f"vision_feature_select_strategy {spec.feature_select!r} is not supported (default, full)")
        self.tower = TOWERS[kind](spec.tower, dtype).to(device)
        width = int(spec.tower["hidden_size"]) * len(spec.feature_layers)
        self.proj_in = LinearParams(cfg.hidden_size, width, dtype, bias=spec.projector_bias)
        self.proj_out = LinearParams(cfg.hidden_size, cfg.hidden_size, dtype, bias=spec.projector_bias)
        self.proj_act = activation(spec.projector_act)
        self.layers_used = self.tower.encoder.absolute(spec.feature_layers)  # (only those layers run)

    def load_vision(self, src: WeightSource) -> None:
        self.tower.load(src, "vision_tower.")
        self.proj_in.load(src, "multi_modal_projector.linear_1")
        self.proj_out.load(src, "multi_modal_projector.linear_2")

    def image_tokens(self, shape: Sequence[int], grid_thw: Sequence[int] | None) -> int:
        want = self.tower.pixel_shape
        if grid_thw is not None or tuple(shape) != want:
            raise ValueError(f"this model's vision tower takes pixels of shape {list(want)} (got {list(shape)}"
                             f"{'' if grid_thw is None else ' with a grid'}); process images with its own processor")
        tokens = self.tower.patches + (1 if self.tower.has_class_token else 0)
        return tokens - 1 if self.vision.feature_select == "default" else tokens

    def encode(self, pixels: list[torch.Tensor], grids: list[list[int] | None]) -> list[torch.Tensor]:
        states = self.tower(torch.stack(pixels).to(self.device), max(self.layers_used))
        picked = [states[i] for i in self.layers_used]
        if self.vision.feature_select == "default":
            picked = [s[:, 1:] for s in picked]
        feats = self.proj_out(self.proj_act(self.proj_in(torch.cat(picked, dim=-1))))
        return list(feats.unbind(0))
