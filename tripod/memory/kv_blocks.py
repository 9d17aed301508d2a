"""The one KV block format: what the disk tier stores and the KV transfer sends.

A *block* is ``block_tokens`` consecutive tokens of a prefix, aligned at a multiple of
``block_tokens`` from position 0, with their rows of every layer (``[layers, block_tokens, *row]``,
the pool's own row layout and dtype). A block's key is a hash chain: ``key[j] = H(key[j-1] ‖
tokens of block j)``, ``key[-1]`` the *identity*, so one key names the whole prefix up to its
block, and another model, dtype or layout has other keys.

Bytes: a header (magic, identity, key, token count, payload length, CRC-32 of tokens and payload),
the block's token ids (int64: the prefix cache's keys, whose image tokens are 62-bit content
hashes: ``prefix_cache.image_key``), the payload. ``check_block`` is the one check of a block, whether it
was read from a file (``disk_tier``) or received from another process (``kv_transfer``).

Identity: ``model_identity`` digests what makes KV rows interchangeable (the model's name,
architecture and a sample of every weight tensor, the dtype, the pool's layout, the compute path);
``pool_layout`` is the block layout of a pool's rows under an identity.
"""

from __future__ import annotations

import hashlib
import json
import struct
import zlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from hashlib import blake2b
from typing import Any

import torch

from tripod.memory.kv_pool import Pool

BLOCK_TOKENS = 16  # the tier's (and the transfer's) block size, unless a caller says otherwise
COPY_BLOCKS = 64  # blocks copied out of a pool at once (bounded copies: never a whole prompt's rows)

MAGIC = b"TPKVBLK2"  # 2: int64 token keys (1 held int32; its files are refused, then replaced)
TOKEN_BYTES = 8
# magic, identity, key, token count, payload bytes, CRC-32 of (tokens ‖ payload)
HEADER = struct.Struct("<8s16s16sIQI")
KEY_BYTES = 16


def chain_keys(identity: bytes, tokens: Sequence[int], block_tokens: int, count: int | None = None) -> list[bytes]:
    """The keys of the first ``count`` whole blocks of ``tokens`` (default: every whole block)."""
    n = len(tokens) // block_tokens if count is None else min(count, len(tokens) // block_tokens)
    keys: list[bytes] = []
    prev = identity
    for j in range(n):
        prev = blake2b(prev + token_bytes(tokens[j * block_tokens : (j + 1) * block_tokens]),
                       digest_size=KEY_BYTES).digest()
        keys.append(prev)
    return keys


def token_bytes(tokens: Sequence[int]) -> bytes:
    return array("q", tokens).tobytes()


def tokens_of(data: bytes | bytearray | memoryview, start: int, count: int) -> list[int]:
    """The ``count`` token keys stored at ``start`` of a block's bytes."""
    return list(memoryview(data)[start : start + TOKEN_BYTES * count].cast("q"))


@dataclass(frozen=True, slots=True)
class TierLayout:
    """What a block holds: ``[num_layers, block_tokens, *row_shape]`` of ``dtype``, for ``identity``."""

    identity: bytes  # KEY_BYTES: digest of the model, dtype and pool layout (the caller's)
    num_layers: int
    row_shape: tuple[int, ...]
    dtype: torch.dtype
    block_tokens: int = 16

    def __post_init__(self) -> None:
        if len(self.identity) != KEY_BYTES:
            raise ValueError(f"identity must be {KEY_BYTES} bytes")
        if self.block_tokens < 1:
            raise ValueError("block_tokens must be >= 1")

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_layers, self.block_tokens, *self.row_shape)

    @property
    def payload_bytes(self) -> int:
        n = self.num_layers * self.block_tokens * torch.empty((), dtype=self.dtype).element_size()
        for d in self.row_shape:
            n *= d
        return n

    @property
    def file_bytes(self) -> int:
        return HEADER.size + TOKEN_BYTES * self.block_tokens + self.payload_bytes


def check_block(lay: TierLayout, data: bytes | bytearray, key: bytes, tokens: Sequence[int]) -> str | None:
    """Why ``data`` is not block ``key`` (of ``tokens``) of ``lay``, or None when it is: the one check of
    a block, whether it was read from a file or received from another process (``kv_transfer``)."""
    if len(data) < HEADER.size:
        return "shorter than its header (torn)"
    magic, ident, fkey, ntok, nbytes, crc = HEADER.unpack_from(data)
    if magic != MAGIC:
        return "not a tripod KV block"
    if ident != lay.identity or fkey != key:
        return "another model's or another prefix's block"
    if ntok != lay.block_tokens or nbytes != lay.payload_bytes:
        return "another block layout"
    if len(data) != lay.file_bytes:
        return f"{len(data)} bytes, not {lay.file_bytes} (torn)"
    toks = bytes(data[HEADER.size : HEADER.size + TOKEN_BYTES * ntok])
    if toks != token_bytes(tokens):
        return "other token ids than its key's"
    if zlib.crc32(memoryview(data)[HEADER.size + TOKEN_BYTES * ntok :], zlib.crc32(toks)) != crc:
        return "checksum mismatch (torn or corrupted)"
    return None


def encode_block(layout: TierLayout, key: bytes, tokens: Sequence[int], rows: torch.Tensor) -> bytes:
    """One block (``rows``: ``[layers, block_tokens, *row]``) as the bytes of its disk-tier file."""
    assert len(tokens) == layout.block_tokens and tuple(rows.shape) == layout.shape
    toks = token_bytes(tokens)
    rows = rows.detach().to("cpu")
    parts = [rows[layer].contiguous().view(torch.uint8).numpy() for layer in range(rows.shape[0])]
    crc = zlib.crc32(toks)
    for part in parts:
        crc = zlib.crc32(part, crc)
    head = HEADER.pack(MAGIC, layout.identity, key, len(tokens), sum(p.nbytes for p in parts), crc)
    return b"".join([head, toks, *(memoryview(p) for p in parts)])


def pool_layout(pool: Pool, identity: bytes, block_tokens: int = BLOCK_TOKENS) -> TierLayout:
    """The block layout of ``pool``'s rows under ``identity`` (the disk tier's and the KV transfer's)."""
    kv = pool.kv
    return TierLayout(identity, kv.shape[0], tuple(kv.shape[2:]), kv.dtype, block_tokens)


def model_identity(*, name: str, architecture: str, model: torch.nn.Module, dtype: torch.dtype, pool: Pool,
                   extra: dict[str, Any]) -> bytes:
    """A 16-byte digest of what the KV rows depend on (see the module docstring)."""
    h = hashlib.blake2b(digest_size=KEY_BYTES)
    desc = {"format": 1, "name": name, "architecture": architecture, "dtype": str(dtype), "kv_dtype": str(pool.kv.dtype),
            "pool": [type(pool).__name__, *pool.kv.shape[0:1], *pool.kv.shape[2:]], **extra}
    h.update(json.dumps(desc, sort_keys=True, default=str).encode())
    for pname, t in sorted(model.state_dict().items()):
        if not isinstance(t, torch.Tensor):
            continue
        h.update(pname.encode())
        h.update(repr((tuple(t.shape), str(t.dtype))).encode())
        try:
            flat = t.detach().reshape(-1)
            sample = flat[:: max(1, flat.numel() // 256)][:256].to("cpu").contiguous()
            h.update(sample.view(torch.uint8).numpy().tobytes())
        except (RuntimeError, TypeError):
            pass  # a packed or exotic tensor: its name, shape and dtype stand for it
    return h.digest()
