"""The served model's image side: ``VisionSide`` (the checkpoint's processor and the image loader)
and whether images are served at all (``images_served``: the processor and the engine must agree)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from PIL import Image

from tripod.protocol.multimodal import ImageInput
from tripod.server.media.loader import ImageLoader

log = logging.getLogger("tripod.server")


class ImageExpander(Protocol):
    """What the server needs of the checkpoint's processor (``tripod.loader.multimodal.VisionProcessor``)."""

    image_token_id: int

    def expand(self, prompt_ids: list[int], images: list[Image.Image], detail: list[str | None] | None = None,
               ) -> tuple[list[int], list[ImageInput]]: ...


@dataclass(slots=True)
class VisionSide:
    """The served model's image side: its processor (the checkpoint's own) and the loader (limits,
    fetching, decoding). ``ServerState.vision`` is None for a text-only model."""

    processor: ImageExpander
    loader: ImageLoader

    @property
    def placeholder_ids(self) -> frozenset[int]:
        """The tokens that stand for images in a prompt: the template's placeholder and (Gemma 3)
        the token the expanded span holds. Text never holds them (``prompt.check_text``)."""
        return frozenset({self.processor.image_token_id,
                          getattr(self.processor, "model_image_token_id", self.processor.image_token_id)})


def images_served(vision: VisionSide | None, modalities: Sequence[str], model: str) -> bool:
    """Whether images are served: the checkpoint has a processor and the engine reads images
    (``Ready.modalities``); a disagreement is logged (images then refused as for a text-only model)."""
    engine = "image" in modalities
    if vision is not None and not engine:
        log.warning("%s has an image processor but the engine reads text only (modalities %s): images are refused",
                    model, list(modalities))
    elif vision is None and engine:
        log.warning("the engine reads images but no image processor was found for %s: images are refused", model)
    return vision is not None and engine
