"""A vision-language checkpoint's own processor, offline: images → pixels and placeholder tokens.

``VisionProcessor.from_folder`` reads the folder's ``config.json`` (the family, its image token
ids, the tower's patch sizes), its image processor (``preprocessor_config.json`` or
``processor_config.json``, PIL backend: never torchvision) and its tokenizer (with its chat template),
never the hub. ``expand`` turns a prompt rendered by that chat template, with one placeholder per
image (what the template writes for a ``{"type": "image"}`` part), into exactly what transformers'
processor makes of the same text and images: each placeholder replaced by the image's tokens (and,
for Gemma 3, its start/end markers and the newlines around them, merged with the prompt's text as
the tokenizer merges them), and one ``ImageInput`` per image (its pixels, span and content hash).

Families: LLaVA-style (``LlavaForConditionalGeneration``: ``<image>`` × the tower's patch count),
Qwen2.5-VL (``<|image_pad|>`` × the merged patch grid; ``detail="low"`` caps the resolution),
Gemma 3 (``<start_of_image>`` → ``\\n\\n<start_of_image>`` + ``<image_soft_token>`` ×
``mm_tokens_per_image`` + ``<end_of_image>\\n\\n``). Torch-free and engine-free: the HTTP process
imports it too.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tripod.models.vision.spec import vlm_family
from tripod.protocol.multimodal import ImageInput, pixel_hash

log = logging.getLogger(__name__)

DETAILS = ("low", "high", "auto")
# detail="low" on a model with resolutions (Qwen2.5-VL): at most this many image tokens.
LOW_DETAIL_TOKENS = 64


@dataclass(frozen=True, slots=True)
class _Processed:
    """One image after the image processor: its pixels (C order), grid and placeholder text."""

    pixels: np.ndarray
    grid_thw: list[int] | None
    tokens: int  # image tokens (embeddings) the tower makes of it
    replacement: str  # what its placeholder becomes in the text


class VisionProcessor:
    """Owns a checkpoint's tokenizer and image processor and the family's placeholder rule.
    Invariant: ``expand`` returns ids in which the model's image token occurs exactly at the
    returned images' spans (``offset``, ``length``), in order, never elsewhere."""

    def __init__(self, folder: Path, family: str, config: dict[str, Any], tokenizer: Any, image_processor: Any) -> None:
        self.folder, self.family, self.config = folder, family, config
        self.tokenizer, self.image_processor = tokenizer, image_processor
        tok = tokenizer
        if family == "llava":
            self.model_image_token_id = int(config.get("image_token_index", config.get("image_token_id", 32000)))
            self.image_token_id = self.model_image_token_id
        elif family == "qwen2_5_vl":
            self.model_image_token_id = int(config.get("image_token_id", 151655))
            self.image_token_id = self.model_image_token_id
        else:  # gemma3: the template writes <start_of_image>; the processor adds the soft tokens
            self.model_image_token_id = int(config.get("image_token_index", config.get("image_token_id", 262144)))
            self.image_token_id = int(config.get("boi_token_index", tok.convert_tokens_to_ids("<start_of_image>")))
            self.eoi_token_id = int(config.get("eoi_token_index", tok.convert_tokens_to_ids("<end_of_image>")))
            if getattr(image_processor, "do_pan_and_scan", False):
                raise ValueError(f"{folder}: Gemma 3's pan-and-scan crops (do_pan_and_scan) are not supported; "
                                 "turn it off in the processor config")
        self.placeholder: str = tok.convert_ids_to_tokens(self.image_token_id)
        self._warned = False

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_folder(cls, folder: str | Path) -> VisionProcessor | None:
        """The processor of the checkpoint in ``folder``; None when the checkpoint is text-only."""
        path = Path(folder).expanduser()
        cfg_path = path / "config.json"
        if not cfg_path.is_file():
            return None
        config = json.loads(cfg_path.read_text())
        family = vlm_family(config)
        if family is None:
            return None
        from transformers import AutoImageProcessor, AutoTokenizer

        try:
            image_processor = AutoImageProcessor.from_pretrained(str(path), backend="pil", local_files_only=True)
        except (OSError, ValueError) as err:
            raise ValueError(f"{path}: the checkpoint's image processor cannot be loaded offline ({err}); "
                             "its preprocessor_config.json or processor_config.json is needed") from err
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        return cls(path, family, config, tokenizer, image_processor)

    @property
    def chat_template(self) -> str | None:
        """The folder's chat template (the tokenizer's, else the processor's ``chat_template.json``)."""
        template = getattr(self.tokenizer, "chat_template", None)
        if template:
            return str(template)
        legacy = self.folder / "chat_template.json"
        if legacy.is_file():
            return str(json.loads(legacy.read_text()).get("chat_template") or "") or None
        return None

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        """Chat messages (content parts ``{"type": "image"}`` / ``{"type": "text", ...}``) through the
        folder's chat template, tokenized: the prompt ``expand`` takes."""
        tok = self.tokenizer
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                       chat_template=self.chat_template)
        # NOTE: as transformers' processor: a template that writes the BOS itself gets no second one.
        bos = getattr(tok, "bos_token", None)
        return list(tok(text, add_special_tokens=not (bos and text.startswith(bos)))["input_ids"])

    # ------------------------------------------------------------------ expanding
    def expand(self, prompt_ids: list[int], images: Sequence[Any],
               detail: Sequence[str | None] | None = None) -> tuple[list[int], list[ImageInput]]:
        """Replace each placeholder of ``prompt_ids`` (in order) by what the checkpoint's processor
        makes of the matching image; the expanded ids and one ``ImageInput`` per image. ``detail``
        (per image: "low" | "high" | "auto" | None) is honoured where the model has resolutions.
        Raises ``ValueError`` for what a caller can fix (counts, unusable images)."""
        places = [i for i, t in enumerate(prompt_ids) if t == self.image_token_id]
        if len(places) != len(images):
            raise ValueError(f"the prompt has {len(places)} image placeholder(s) ({self.placeholder!r}) but "
                             f"{len(images)} image(s) were given; give one image per image part of the messages")
        if not images:
            return list(prompt_ids), []
        if detail is not None and len(detail) != len(images):
            raise ValueError(f"detail: {len(detail)} values for {len(images)} images")
        done = [self._process(i, im, None if detail is None else detail[i]) for i, im in enumerate(images)]
        ids = self._splice(prompt_ids, places, done)
        return ids, self._inputs(ids, done)

    def _process(self, index: int, image: Any, detail: str | None) -> _Processed:
        if detail is not None and detail not in DETAILS:
            raise ValueError(f"image {index}: detail must be one of {', '.join(DETAILS)} (got {detail!r})")
        size = getattr(image, "size", None)
        if size is None or not hasattr(image, "convert"):
            raise ValueError(f"image {index} is not an image (a PIL image is expected)")
        if min(size) < 1:
            raise ValueError(f"image {index} is {size[0]}x{size[1]} pixels: it has no pixels")
        try:
            out = self.image_processor(images=[to_rgb(image)], return_tensors="np", **self._kwargs(detail))
        except ValueError as err:
            raise ValueError(f"image {index} ({size[0]}x{size[1]} pixels) cannot be used by this model: {err}") from err
        pixels = np.ascontiguousarray(np.asarray(out["pixel_values"], dtype=np.float32))
        if self.family == "qwen2_5_vl":
            grid = [int(v) for v in np.asarray(out["image_grid_thw"])[0]]
            merge = int(self.config.get("vision_config", {}).get("spatial_merge_size", 2))
            tokens = grid[0] * grid[1] * grid[2] // (merge * merge)
            return _Processed(pixels, grid, tokens, self.placeholder * tokens)
        pixels = pixels[0]  # [C, H, W]
        if self.family == "llava":
            tokens = self._llava_tokens(pixels.shape[-2], pixels.shape[-1])
            return _Processed(pixels, None, tokens, self.placeholder * tokens)
        tokens = int(self.config.get("mm_tokens_per_image", 256))
        tok = self.tokenizer
        soft = tok.convert_ids_to_tokens(self.model_image_token_id) * tokens
        text = f"\n\n{self.placeholder}{soft}{tok.convert_ids_to_tokens(self.eoi_token_id)}\n\n"
        return _Processed(pixels, None, tokens, text)

    def _kwargs(self, detail: str | None) -> dict[str, Any]:
        """Image processor arguments for ``detail``: Qwen2.5-VL's "low" caps the pixels."""
        if self.family != "qwen2_5_vl" or detail != "low":
            return {}
        ip = self.image_processor
        size = dict(getattr(ip, "size", None) or {})
        vision = self.config.get("vision_config", {})
        factor = int(vision.get("patch_size", 14)) * int(vision.get("spatial_merge_size", 2))
        low = LOW_DETAIL_TOKENS * factor * factor
        floor = int(size.get("shortest_edge") or 0)
        size["longest_edge"] = max(min(int(size.get("longest_edge") or low), low), floor)
        return {"size": size}

    def _llava_tokens(self, height: int, width: int) -> int:
        """The tower's patches (+ CLIP's class token), less that token under the "default" selection."""
        vision = self.config.get("vision_config", {})
        patch = int(vision.get("patch_size", 14))
        tokens = (height // patch) * (width // patch)
        if vision.get("model_type", "clip_vision_model") == "clip_vision_model":
            tokens += 1
        if self.config.get("vision_feature_select_strategy", "default") == "default":
            tokens -= 1
        return tokens

    def _splice(self, prompt_ids: list[int], places: list[int], done: list[_Processed]) -> list[int]:
        """The prompt with each placeholder replaced. Replacements made of special tokens only are
        spliced id for id; others (Gemma 3's newlines) are put into the prompt's text and the text
        tokenized again, so they merge with their neighbours exactly as in transformers."""
        tok = self.tokenizer
        pieces = [tok.encode(d.replacement, add_special_tokens=False) for d in done]
        if self.family != "gemma3":
            return _splice_ids(prompt_ids, places, pieces)
        text = tok.decode(prompt_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if tok.encode(text, add_special_tokens=False) != list(prompt_ids):
            if not self._warned:  # not the tokenizer's own encoding of a text: splice the ids
                log.warning("%s: a prompt's token ids are not the tokenizer's encoding of their text; image markers "
                            "are spliced by id (their newlines may tokenize differently from transformers')",
                            self.folder.name)
                self._warned = True
            return _splice_ids(prompt_ids, places, pieces)
        parts = text.split(self.placeholder)
        assert len(parts) == len(done) + 1, "a placeholder's text occurs where its token does not"
        out = parts[0]
        for d, rest in zip(done, parts[1:], strict=True):
            out += d.replacement + rest
        return list(tok.encode(out, add_special_tokens=False))

    def _inputs(self, ids: list[int], done: list[_Processed]) -> list[ImageInput]:
        """One ``ImageInput`` per image: the next run of its tokens in ``ids``."""
        token = self.model_image_token_id
        where = [i for i, t in enumerate(ids) if t == token]
        if len(where) != sum(d.tokens for d in done):
            raise ValueError(f"the prompt contains the image token {self.tokenizer.convert_ids_to_tokens(token)!r} "
                             "outside the images' placeholders; remove it from the text")
        out: list[ImageInput] = []
        k = 0
        for d in done:
            offset = where[k]
            assert where[k + d.tokens - 1] == offset + d.tokens - 1, "an image's tokens are not contiguous"
            shape = [int(s) for s in d.pixels.shape]
            raw = d.pixels.tobytes()
            out.append(ImageInput(hash=pixel_hash(raw, shape, d.grid_thw), offset=offset, length=d.tokens,
                                  pixels=raw, shape=shape, grid_thw=d.grid_thw))
            k += d.tokens
        return out


def to_rgb(img: Any) -> Any:
    """RGB, transparency composited onto white: exactly what transformers' ``convert_to_rgb`` makes,
    so a processor that converts again changes nothing (parity with HF), and one that does not
    still gets the three channels its model reads."""
    if "A" in img.getbands() or img.info.get("transparency") is not None:  # (an RGB image may have one too)
        from PIL import Image

        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return img if img.mode == "RGB" else img.convert("RGB")


def _splice_ids(prompt_ids: list[int], places: list[int], pieces: list[list[int]]) -> list[int]:
    out: list[int] = []
    prev = 0
    for at, piece in zip(places, pieces, strict=True):
        out += prompt_ids[prev:at]
        out += piece
        prev = at + 1
    return out + prompt_ids[prev:]
