"""The one KV block format: what the disk tier stores and the KV transfer sends.

A *block* is ``block_tokens`` consecutive tokens of a prefix, aligned at a multiple of
``block_tokens`` from position 0, with their rows of every layer (``[layers, block_tokens, *row]``,
the pool's own row layout and dtype). A block's key is a hash chain: ``key[j] = H(key[j-1] ‖
tokens of block j)``, ``key[-1]`` the *identity*, so one key names the whole prefix up to its
block, and another model, dtype or layout has other keys.

Bytes (format version 3): a header (``TPKVBLK`` and a version byte, identity, key, token count, KV
payload length, state length, CRC-32 of tokens, payload and state), the block's token ids (int64:
the prefix cache's keys, whose image tokens are 62-bit content hashes: ``prefix_cache.image_key``),
the KV payload, the state. ``check_block`` is the one check of a block, whether it was read from a
file (``disk_tier``) or received from another process (``kv_transfer``). Files of an older format
(version 1: int32 tokens; 2: no state section) fail it: the tier removes them and writes the block
again in this format when the prefix is next saved.

*Snapshot blocks* (a hybrid model's, ``TierLayout.state_bytes`` > 0): the state of every linear
layer after position ``p`` of a prefix, with the *tail* ``tokens[p // B * B : p]`` (0 to ``B - 1``
tokens, their KV rows as the payload), keyed ``snapshot_key(key[p // B - 1], tail)`` (another hash
domain than the chain's, so a snapshot never answers for a KV block). With the whole blocks before
it, a snapshot block resumes the prefix exactly at ``p``.

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

MAGIC_PREFIX = b"TPKVBLK"
# 3: a state section (hybrid models' snapshots). 2: int64 token keys, no state; 1: int32 token keys.
# Older versions' files are refused on read (then removed and written again in this version).
VERSION = 3
MAGIC = MAGIC_PREFIX + bytes([VERSION])
OLD_MAGICS = {b"TPKVBLK1": 1, b"TPKVBLK2": 2}  # (versions 1 and 2 spelled theirs as an ASCII digit)
TOKEN_BYTES = 8
# magic+version, identity, key, token count, KV payload bytes, state bytes, CRC-32 of (tokens ‖ payload ‖ state)
HEADER = struct.Struct("<8s16s16sIQQI")
OLD_HEADER = struct.Struct("<8s16s16sIQI")  # version 2's (no state length)
KEY_BYTES = 16
SNAPSHOT_PERSON = b"tripod-state"  # the hash domain of snapshot keys


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


def snapshot_key(prev: bytes, tail: Sequence[int]) -> bytes:
    """The key of the snapshot block after ``tail`` (the tokens past the whole block keyed ``prev``;
    the identity for a snapshot inside block 0)."""
    return blake2b(prev + token_bytes(tail), digest_size=KEY_BYTES, person=SNAPSHOT_PERSON).digest()


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
    state_bytes: int = 0  # one snapshot's state (a hybrid model's linear layers, float32); 0: none

    def __post_init__(self) -> None:
        if len(self.identity) != KEY_BYTES:
            raise ValueError(f"identity must be {KEY_BYTES} bytes")
        if self.block_tokens < 1:
            raise ValueError("block_tokens must be >= 1")

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_layers, self.block_tokens, *self.row_shape)

    @property
    def token_row_bytes(self) -> int:
        """Bytes of one token's rows over every layer."""
        n = self.num_layers * torch.empty((), dtype=self.dtype).element_size()
        for d in self.row_shape:
            n *= d
        return n

    @property
    def payload_bytes(self) -> int:
        return self.block_tokens * self.token_row_bytes

    @property
    def file_bytes(self) -> int:
        return HEADER.size + TOKEN_BYTES * self.block_tokens + self.payload_bytes

    def snapshot_file_bytes(self, tail: int) -> int:
        """Bytes of a snapshot block with ``tail`` tokens."""
        return HEADER.size + (TOKEN_BYTES + self.token_row_bytes) * tail + self.state_bytes

    def tail_shape(self, tail: int) -> tuple[int, ...]:
        return (self.num_layers, tail, *self.row_shape)


def block_format(data: bytes | bytearray) -> str | None:
    """Why ``data`` is not of this block format (another file, an older version), or None."""
    magic = bytes(data[: len(MAGIC)])
    if magic in OLD_MAGICS:
        return f"an older block format (version {OLD_MAGICS[magic]}, this is {VERSION}): refused, written again"
    if magic[: len(MAGIC_PREFIX)] == MAGIC_PREFIX and magic != MAGIC:
        return f"block format version {magic[-1]} (this is {VERSION})"
    if magic != MAGIC:
        return "not a tripod KV block"
    return None


def check_block(lay: TierLayout, data: bytes | bytearray, key: bytes, tokens: Sequence[int], *,
                snapshot: bool = False) -> str | None:
    """Why ``data`` is not block ``key`` (of ``tokens``) of ``lay`` (``snapshot``: a snapshot block, whose
    ``tokens`` are its tail), or None when it is: the one check of a block, whether it was read from a
    file or received from another process (``kv_transfer``)."""
    if len(data) < len(MAGIC):
        return "shorter than its header (torn)"
    why = block_format(data)
    if why is not None:
        return why
    if len(data) < HEADER.size:
        return "shorter than its header (torn)"
    _, ident, fkey, ntok, nbytes, sbytes, crc = HEADER.unpack_from(data)
    if ident != lay.identity or fkey != key:
        return "another model's or another prefix's block"
    if snapshot:
        if ntok != len(tokens) or ntok >= lay.block_tokens or nbytes != ntok * lay.token_row_bytes \
                or sbytes != lay.state_bytes or not sbytes:
            return "another snapshot layout"
        size = lay.snapshot_file_bytes(ntok)
    else:
        if ntok != lay.block_tokens or nbytes != lay.payload_bytes or sbytes:
            return "another block layout"
        size = lay.file_bytes
    if len(data) != size:
        return f"{len(data)} bytes, not {size} (torn)"
    toks = bytes(data[HEADER.size : HEADER.size + TOKEN_BYTES * ntok])
    if toks != token_bytes(tokens):
        return "other token ids than its key's"
    if zlib.crc32(memoryview(data)[HEADER.size + TOKEN_BYTES * ntok :], zlib.crc32(toks)) != crc:
        return "checksum mismatch (torn or corrupted)"
    return None


def encode_block(layout: TierLayout, key: bytes, tokens: Sequence[int], rows: torch.Tensor,
                 state: torch.Tensor | None = None) -> bytes:
    """One block (``rows``: ``[layers, tokens, *row]``) as the bytes of its disk-tier file; with
    ``state`` (a snapshot's flat float32 values) a snapshot block, ``tokens`` its tail."""
    return b"".join(block_parts(layout, key, tokens, rows, state))


def block_parts(layout: TierLayout, key: bytes, tokens: Sequence[int], rows: torch.Tensor,
                state: torch.Tensor | None = None) -> list[bytes | memoryview]:
    """The pieces of a block's bytes, in order (header, tokens, each layer's rows, the state)."""
    if state is None:
        assert len(tokens) == layout.block_tokens and tuple(rows.shape) == layout.shape
    else:
        assert len(tokens) < layout.block_tokens and tuple(rows.shape) == layout.tail_shape(len(tokens))
        assert state.dtype == torch.float32 and state.numel() * 4 == layout.state_bytes
    toks = token_bytes(tokens)
    rows = rows.detach().to("cpu")
    parts = [rows[layer].contiguous().view(torch.uint8).numpy() for layer in range(rows.shape[0])]
    if state is not None:
        parts.append(state.detach().to("cpu").contiguous().view(torch.uint8).numpy())
    crc = zlib.crc32(toks)
    for part in parts:
        crc = zlib.crc32(part, crc)
    nbytes = sum(p.nbytes for p in parts[: rows.shape[0]])
    head = HEADER.pack(MAGIC, layout.identity, key, len(tokens), nbytes, 0 if state is None else layout.state_bytes, crc)
    return [head, toks, *(memoryview(p) for p in parts)]


def split_block(layout: TierLayout, data: bytes | bytearray) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A checked block's rows (``[layers, tokens, *row]``) and, for a snapshot block, its state."""
    ntok, nbytes, sbytes = HEADER.unpack_from(data)[3:6]
    start = HEADER.size + TOKEN_BYTES * ntok
    buf = data if isinstance(data, bytearray) else bytearray(data)
    rows = torch.frombuffer(buf, dtype=torch.uint8, offset=start, count=nbytes) if nbytes else \
        torch.empty(0, dtype=torch.uint8)
    rows = rows.view(layout.dtype).view(layout.tail_shape(ntok))
    if not sbytes:
        return rows, None
    return rows, torch.frombuffer(buf, dtype=torch.uint8, offset=start + nbytes, count=sbytes).view(torch.float32)


def pool_layout(pool: Pool, identity: bytes, block_tokens: int = BLOCK_TOKENS, state_bytes: int = 0) -> TierLayout:
    """The block layout of ``pool``'s rows under ``identity`` (the disk tier's and the KV transfer's);
    ``state_bytes``: a hybrid model's snapshot size."""
    kv = pool.kv
    return TierLayout(identity, kv.shape[0], tuple(kv.shape[2:]), kv.dtype, block_tokens, state_bytes)


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
