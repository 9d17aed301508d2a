"""A request's images inside the engine: ``PromptImages``, shared by the request's ``n`` copies.

It holds the validated ``ImageInput``s (pixels, spans, content digests), the prompt's prefix-cache
key (the prompt with each image span keyed by the image's content: ``memory.prefix_cache.image_key``),
Qwen2.5-VL's 3-D RoPE positions of the prompt and decode delta, and, for models whose image tokens
attend to each other both ways (Gemma 3), the rule that an image's tokens are computed in one chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tripod.protocol.multimodal import ImageInput


@dataclass(slots=True, eq=False)
class PromptImages:
    """The images of one request (see the module docstring). Invariant: ``inputs`` are in prompt
    order, their spans inside the prompt and disjoint, and every token in them is the model's image token."""

    inputs: list[ImageInput]
    key: list[int]  # the prompt's prefix-cache key (image spans keyed by content)
    positions: torch.Tensor | None = None  # M-RoPE: [3, prompt_len]
    delta: int = 0  # M-RoPE: decode position = sequence index + delta
    whole: bool = False  # an image's tokens must be computed in one prefill chunk (bidirectional attention)

    @property
    def tokens(self) -> int:
        """Image tokens in the prompt."""
        return sum(im.length for im in self.inputs)

    def overlaps(self, start: int, end: int) -> list[tuple[int, int, int]]:
        """(image index, first, end) of the image tokens among sequence positions ``[start, end)``."""
        out = []
        for i, im in enumerate(self.inputs):
            lo, hi = max(start, im.offset), min(end, im.offset + im.length)
            if lo < hi:
                out.append((i, lo, hi))
        return out

    def chunk(self, start: int, n: int) -> int:
        """A prefill chunk of ``n`` tokens from ``start``, moved to an image boundary where it would
        end inside an image whose tokens must be computed together: cut before the image, or (the
        chunk starts in or at it) extended to its end. Otherwise ``n``."""
        if not self.whole:
            return n
        end = start + n
        for im in self.inputs:
            if im.offset < end < im.offset + im.length:
                return im.offset - start if im.offset > start else im.offset + im.length - start
        return n

    def rope_positions(self, start: int, n: int) -> torch.Tensor:
        """M-RoPE positions ``[3, n]`` of sequence positions ``[start, start + n)``: the prompt's
        table, then (generated tokens) the index plus ``delta`` on every axis."""
        assert self.positions is not None
        plen = self.positions.shape[1]
        out = torch.empty(3, n, dtype=torch.long)
        inside = max(0, min(n, plen - start))
        if inside:
            out[:, :inside] = self.positions[:, start : start + inside]
        if inside < n:
            out[:, inside:] = torch.arange(start + inside, start + n) + self.delta
        return out
