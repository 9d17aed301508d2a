"""A conversation with images → prompt token ids and the images the engine needs: ``render_prompt``,
the one path every surface's prompt takes (chat, messages, responses, count_tokens, tokenize).

```
Messages (text + ImageRefs, in order)
  │ text-only model? 400 (the model takes text only) · too many images? a URL not allowed? 400
  ▼ ChatRenderer: the chat template, one placeholder per image part → prompt ids
  ▼ ImageLoader: fetch / base64 → bytes → PIL (worker threads), every limit checked
  ▼ VisionProcessor.expand (worker thread): each placeholder → the image's tokens; ImageInput per image
Prompt(ids, images)  → EnginePart → AddRequest.images
```

Image tokens are prompt tokens from here on: the context check (``max_model_len``), the tenants'
token limits and ``usage.prompt_tokens`` all count ``Prompt.ids``, which holds them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from PIL import Image

from tripod.protocol.multimodal import ImageInput
from tripod.server.answer.conversation import Message
from tripod.server.answer.tools import ToolSpec
from tripod.server.media.sources import ImageError, ImageRef
from tripod.server.media.vision import ImageExpander, VisionSide
from tripod.server.state import ServerState


@dataclass(slots=True)
class Prompt:
    """A rendered prompt: token ids (image tokens included) and its images, in prompt order."""

    ids: list[int]
    images: list[ImageInput] = field(default_factory=list)
    # The pictures loaded for its ImageRefs (a re-render of part of the conversation reuses them).
    pictures: dict[ImageRef, Image.Image] = field(default_factory=dict)

    @property
    def image_tokens(self) -> int:
        return sum(i.length for i in self.images)

    @property
    def note(self) -> str:
        """For messages about the prompt's length: how much of it is images."""
        if not self.images:
            return ""
        return f" ({self.image_tokens} of them for {len(self.images)} image{'s' if len(self.images) > 1 else ''})"


def images_of(messages: Sequence[Message]) -> list[ImageRef]:
    return [r for m in messages for r in m.images]


def vision_for(state: ServerState, refs: list[ImageRef]) -> VisionSide:
    """The vision side that will read ``refs``, or a 400: the model takes text only, too many
    images, a URL that may not be fetched (all before anything is fetched)."""
    if state.vision is None or not state.takes_images:
        raise ImageError(f"'{refs[0].param}': the model {state.model_name!r} takes text only and cannot read images; "
                         "remove the image parts, or send them to a server running a vision-language model",
                         refs[0].param, "model_takes_text_only")
    state.vision.loader.check(refs)
    return state.vision


async def render_prompt(state: ServerState, messages: list[Message], tools: list[ToolSpec] | None = None, *,
                        continue_final: bool = False, param: str = "messages",
                        pictures: dict[ImageRef, Image.Image] | None = None) -> Prompt:
    """``messages`` rendered with the chat template, each image expanded into its tokens.
    ``pictures``: images loaded already (by an earlier render of the same conversation)."""
    refs = images_of(messages)
    if not refs:
        ids = state.chat.render(messages, tools, continue_final=continue_final, param=param)
        check_text(state, ids, param)
        return Prompt(ids)
    metrics = state.metrics
    try:
        vision = vision_for(state, refs)
        ids = state.chat.render(messages, tools, continue_final=continue_final, param=param)
        t0 = time.perf_counter()
        known = pictures or {}
        missing = [r for r in refs if r not in known]
        for r in missing:
            metrics.images_received.labels(metrics.model_name, r.source).inc()
        loaded = dict(zip(missing, await vision.loader.load(missing), strict=True)) if missing else {}
        have = {**known, **loaded}
        expanded, inputs = await asyncio.to_thread(_expand, vision.processor, ids, [have[r] for r in refs],
                                                   [r.detail for r in refs], param)
    except ImageError as e:
        metrics.images_refused.labels(metrics.model_name, e.code or "invalid_image").inc()
        raise
    metrics.image_load_seconds.labels(metrics.model_name).observe(time.perf_counter() - t0)
    return Prompt(expanded, inputs, have)


def check_text(state: ServerState, ids: list[int], param: str) -> None:
    """A 400 when a prompt without images holds a token that stands for an image (the text spelled
    the placeholder, or a prompt of token ids named it): the engine would have no image for it."""
    if state.vision is None:
        return
    bad = state.vision.placeholder_ids.intersection(ids)
    if bad:
        shown = state.text.decode([min(bad)], skip_special_tokens=False)
        raise ImageError(f"'{param}': the prompt holds the model's image token {shown!r} (id {min(bad)}) without an "
                         "image; remove it from the text (images go in image content parts)", param, "invalid_image")


def _expand(processor: ImageExpander, ids: list[int], images: list[Image.Image], detail: list[str | None],
            param: str) -> tuple[list[int], list[ImageInput]]:
    """The processor's expansion; a ValueError (the caller's images or their placement) is a 400."""
    try:
        out_ids, inputs = processor.expand(ids, images, detail)
    except ValueError as e:
        raise ImageError(f"'{param}': the model's processor refused the images: {e}", param, "invalid_image") from None
    if len(inputs) != len(images):
        # NOTE: a template that drops image parts (e.g. from a system message) leaves an image
        # without a placeholder: refused rather than silently left out.
        raise ImageError(f"'{param}': the model's chat template placed {len(inputs)} of the {len(images)} images; "
                         "put images in user messages", param, "invalid_image")
    return out_ids, inputs
