"""Image tokens in the prefix cache's keys (``memory.prefix_cache.image_key``) and in the KV block
format (int64 token keys): one image's keys are its own at every place, another image's differ at
every place, no key is a text id, and the blocks carry and check them."""

from __future__ import annotations

import hashlib

import torch

from tripod.memory.kv_blocks import (
    HEADER,
    TierLayout,
    chain_keys,
    check_block,
    encode_block,
    tokens_of,
)
from tripod.memory.kv_pool import SlotAllocator
from tripod.memory.prefix_cache import (
    MAX_NAMESPACES,
    NAMESPACE_STRIDE,
    image_key,
    keyed_with_images,
)
from tripod.memory.radix_cache import RadixCache


def _digest(n: int) -> str:
    return hashlib.sha256(str(n).encode()).hexdigest()


def test_image_keys_are_per_image_and_place_and_never_text_ids() -> None:
    a, b = image_key(_digest(1), 64), image_key(_digest(2), 64)
    assert a == image_key(_digest(1), 64) and a[:10] == image_key(_digest(1), 10)
    assert len(set(a)) == 64 and all(x != y for x, y in zip(a, b, strict=True))
    top_text = (MAX_NAMESPACES + 1) * NAMESPACE_STRIDE
    assert all(-(1 << 62) <= k < 0 for k in a + b) and top_text <= 1 << 31
    ids = [5, 6, 9, 9, 9, 7]
    assert keyed_with_images(ids, [(_digest(1), 2, 3)]) == [5, 6, *image_key(_digest(1), 3), 7]


def test_the_radix_cache_shares_one_image_and_never_another() -> None:
    cache = RadixCache(SlotAllocator(64))
    ids = [1, 2, 3, 9, 9, 9, 9, 4]
    one, other = keyed_with_images(ids, [(_digest(1), 3, 4)]), keyed_with_images(ids, [(_digest(2), 3, 4)])
    slots = cache.allocator.alloc(len(one))
    assert slots is not None
    cache.insert(one, slots)
    assert len(cache.match_prefix(one[:-1]).slots) == 7
    assert len(cache.match_prefix(other[:-1]).slots) == 3  # the text before the image only


def test_blocks_carry_and_check_image_keys() -> None:
    lay = TierLayout(b"i" * 16, 2, (2, 1, 4), torch.float32, block_tokens=4)
    tokens = keyed_with_images([1, 2, 9, 9], [(_digest(3), 2, 2)])
    (key,) = chain_keys(lay.identity, tokens, 4)
    data = encode_block(lay, key, tokens, torch.randn(lay.shape))
    assert len(data) == lay.file_bytes and tokens_of(data, HEADER.size, 4) == tokens
    assert check_block(lay, data, key, tokens) is None
    other = keyed_with_images([1, 2, 9, 9], [(_digest(4), 2, 2)])
    assert chain_keys(lay.identity, other, 4) != [key] and check_block(lay, data, key, other) is not None
