"""``PromptImages`` (``engine/images.py``): where a chunk may end, which image tokens a chunk
holds, and a prompt's M-RoPE positions past its end."""

from __future__ import annotations

import torch

from tripod.engine.images import PromptImages
from tripod.protocol.multimodal import ImageInput, pixel_hash


def _image(offset: int, length: int) -> ImageInput:
    raw = bytes(4 * 3)
    return ImageInput(hash=pixel_hash(raw, [3], None), offset=offset, length=length, pixels=raw, shape=[3])


def test_a_whole_image_chunk_moves_to_the_image_boundaries() -> None:
    imgs = PromptImages([_image(4, 10), _image(20, 6)], key=[], whole=True)
    assert imgs.chunk(0, 8) == 4  # would end inside image 0: cut before it
    assert imgs.chunk(4, 8) == 10  # starts at image 0: extended over all of it
    assert imgs.chunk(7, 2) == 7  # starts inside it (a cached prefix ended there): to its end
    assert imgs.chunk(14, 6) == 6 and imgs.chunk(0, 4) == 4 and imgs.chunk(14, 8) == 6
    free = PromptImages([_image(4, 10)], key=[])
    assert free.chunk(0, 8) == 8  # (images attended causally: any chunk)


def test_overlaps_and_positions_past_the_prompt() -> None:
    imgs = PromptImages([_image(4, 10), _image(20, 6)], key=[])
    assert imgs.overlaps(0, 4) == [] and imgs.overlaps(10, 22) == [(0, 10, 14), (1, 20, 22)]
    pos = torch.arange(30).expand(3, 30).clone()
    pos[1, 4:14] = 99
    imgs.positions, imgs.delta = pos, -5
    out = imgs.rope_positions(28, 4)
    assert out[:, :2].tolist() == pos[:, 28:30].tolist() and out[:, 2:].tolist() == [[25, 26]] * 3
    assert imgs.rope_positions(3, 2)[1].tolist() == [3, 99]
