"""Images of a request, as they cross the server → engine pipe (issue 38: vision inputs).

The HTTP process owns everything about an image that is not numeric model work: it fetches or
decodes the bytes, runs the checkpoint's own processor (resize, normalise, patchify; the number of
placeholder tokens the image fills in the prompt), and hashes the result. The engine process gets
the processed pixels and runs the vision tower. Torch-free: pixels travel as raw bytes.

An image's ``hash`` is its identity everywhere in the engine: the prefix cache keys its
placeholder tokens by it (two requests with the same image share that KV, two different images
never do), and the encoder's outputs are kept under it for a request's lifetime.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Annotated

import msgspec

# What a pixel tensor may be on the wire (its element type); the engine converts to its dtype.
PIXEL_DTYPES = ("float32",)


def pixel_hash(pixels: bytes, shape: Sequence[int], grid_thw: Sequence[int] | None) -> str:
    """An image's identity: sha256 over its processed pixels, their shape and grid. The processor
    (``loader/multimodal.py``) stamps it; the engine recomputes it before trusting it as a cache key."""
    h = hashlib.sha256()
    h.update(repr((tuple(int(d) for d in shape), tuple(int(d) for d in grid_thw) if grid_thw else None)).encode())
    h.update(pixels)
    return h.hexdigest()


class ImageInput(msgspec.Struct, kw_only=True, frozen=True):
    """One image of one request, processed: ``length`` placeholder tokens from ``offset`` in the
    request's ``prompt_ids`` are replaced by the vision tower's embeddings of ``pixels``."""

    # Hex digest (sha256) of the processed pixels, their shape and grid: the cache identity.
    hash: Annotated[str, msgspec.Meta(min_length=16, max_length=128)]
    offset: Annotated[int, msgspec.Meta(ge=0)]  # index in prompt_ids of the first placeholder
    length: Annotated[int, msgspec.Meta(gt=0)]  # placeholder tokens this image's embeddings fill
    pixels: bytes  # the processor's pixel_values for this image, C order, ``dtype``
    shape: list[Annotated[int, msgspec.Meta(gt=0)]]
    dtype: str = "float32"
    # Qwen2.5-VL's (t, h, w) patch grid of the image; None for fixed-resolution towers.
    grid_thw: list[Annotated[int, msgspec.Meta(gt=0)]] | None = None

    def __post_init__(self) -> None:
        if self.dtype not in PIXEL_DTYPES:
            raise ValueError(f"image pixels must be one of {PIXEL_DTYPES}, not {self.dtype!r}")
        count = 1
        for dim in self.shape:
            count *= dim
        if count * 4 != len(self.pixels):
            raise ValueError(f"image pixels: {len(self.pixels)} bytes do not hold shape {self.shape} of {self.dtype}")
        if self.grid_thw is not None and len(self.grid_thw) != 3:
            raise ValueError("grid_thw must be (t, h, w)")


class ImageSpan(msgspec.Struct, array_like=True, frozen=True):
    """Where an image's tokens are in a prompt and what it is, without its pixels: what keys its
    tokens in the prefix cache (``ExportKV.images``: a prefill replica exports a prompt's KV)."""

    hash: Annotated[str, msgspec.Meta(min_length=16, max_length=128)]
    offset: Annotated[int, msgspec.Meta(ge=0)]
    length: Annotated[int, msgspec.Meta(gt=0)]
