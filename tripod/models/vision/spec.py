"""What a vision-language checkpoint adds to its decoder's config (torch-free: the HTTP process's
processor reads the family here too).

``vlm_family`` names the family of an HF ``config.json``; ``VisionSpec`` is the part of
``ModelConfig`` that says how images become decoder inputs: the image token, the tower's config,
the feature selection and projector (LLaVA), the soft tokens per image (Gemma 3), the M-RoPE
sections (Qwen2.5-VL) and whether an image's tokens attend to each other both ways (Gemma 3).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

VLM_ARCHITECTURES = {
    "LlavaForConditionalGeneration": "llava",
    "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl",
    "Gemma3ForConditionalGeneration": "gemma3",
}


def vlm_family(config: dict[str, Any]) -> str | None:
    """The vision-language family of an HF ``config.json`` (None: a text-only model)."""
    archs = config.get("architectures") or []
    if archs and str(archs[0]) in VLM_ARCHITECTURES:
        return VLM_ARCHITECTURES[str(archs[0])]
    mtype = config.get("model_type")
    if mtype in ("llava", "qwen2_5_vl") or (mtype == "gemma3" and config.get("vision_config")):
        return str(mtype)
    return None


@dataclass(frozen=True, slots=True)
class VisionSpec:
    """How a vision-language model turns images into decoder inputs (see the module docstring)."""

    family: str  # "llava" | "qwen2_5_vl" | "gemma3"
    image_token_id: int  # the token whose embeddings the images' features replace
    tower: dict[str, Any] = field(compare=False, hash=False)  # the checkpoint's vision_config
    feature_layers: tuple[int, ...] = (-2,)  # LLaVA: the tower hidden states concatenated
    feature_select: str = "default"  # LLaVA: "default" drops the first (class) token, "full" keeps all
    projector_act: str = "gelu"
    projector_bias: bool = True
    tokens_per_image: int = 0  # Gemma 3: soft tokens per image (the pooled patch grid)
    mrope_section: tuple[int, ...] | None = None  # Qwen2.5-VL: rotary frequencies per (t, h, w) axis
    bidirectional: bool = False  # Gemma 3: an image's tokens attend to each other both ways
    text_qkv_bias: bool = False  # a Qwen2-style decoder: biases on Q/K/V (not O)

    @classmethod
    def from_hf(cls, d: dict[str, Any], family: str) -> VisionSpec:
        tower = dict(d.get("vision_config") or {})
        if family == "llava":
            layers = d.get("vision_feature_layer", -2)
            text_type = str((d.get("text_config") or {}).get("model_type") or "llama")
            return cls("llava", int(d.get("image_token_index", d.get("image_token_id", 32000))), tower,
                       feature_layers=tuple(layers) if isinstance(layers, list) else (int(layers),),
                       feature_select=str(d.get("vision_feature_select_strategy", "default")),
                       projector_act=str(d.get("projector_hidden_act", "gelu")),
                       projector_bias=bool(d.get("multimodal_projector_bias", True)),
                       text_qkv_bias=text_type.startswith("qwen2"))
        if family == "qwen2_5_vl":
            text = d.get("text_config") or d
            rope = text.get("rope_parameters") or text.get("rope_scaling") or d.get("rope_scaling") or {}
            section = rope.get("mrope_section") or [16, 24, 24]
            return cls("qwen2_5_vl", int(d.get("image_token_id", 151655)), tower,
                       mrope_section=tuple(int(s) for s in section), text_qkv_bias=True)
        return cls("gemma3", int(d.get("image_token_index", d.get("image_token_id", 262144))), tower,
                   tokens_per_image=int(d.get("mm_tokens_per_image", 256)), bidirectional=True)
