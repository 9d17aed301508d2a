"""A prompt's KV between processes, in the disk tier's block format (prefill/decode disaggregation).

A prefill replica computes a prompt's KV and sends its whole blocks to a decode replica; for a hybrid
model, then a snapshot block (``kv_blocks``: the recurrent state after the last exported token and
the tail of tokens since the last whole block), without which the blocks could not resume it. Each block
travels as exactly the bytes of a disk-tier file (``kv_blocks``: a header with the magic, the
identity, the key, the token count, the payload length and a CRC-32; the token ids; the rows of
every layer), one after another in one HTTP body. So there is one block format, one identity
(``kv_blocks.model_identity``) and one check (``kv_blocks.check_block``) for both. The sender's
side is ``export_prefix``: the whole blocks of a prompt the prefix cache holds.

The receiver (``BlockReceiver``) verifies every block as a file read would, and recomputes the hash
chain from *its own* identity: a block lands only under the key of the prefix that produced it, and
a sender with another model, dtype, KV layout or compute path is refused at its first header
(``TransferRefused``, 409). Verified blocks are published into the receiver's disk-tier directory
atomically (temp file, ``os.replace``), where its engine's admission of the prompt finds and loads
them (``TieredCache.load``). A stream cut part-way (the sender died) leaves only whole, verified
blocks of a prefix: a shorter cached prefix, never a wrong one.

What is copied (no zero-copy path on TCP): the engine copies the rows out of its pool and encodes
them (one copy), msgpack carries the bytes to the HTTP process (one), TCP to the receiver, whose
HTTP process assembles each block (one) and writes it (the page cache: memory on tmpfs, where a
``--role decode`` replica puts its private tier); its engine reads the file (one) and copies the
rows into its pool (one).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from hashlib import blake2b
from pathlib import Path

import torch

from tripod.memory.kv_blocks import (
    COPY_BLOCKS,
    HEADER,
    KEY_BYTES,
    MAGIC,
    TierLayout,
    block_format,
    chain_keys,
    check_block,
    encode_block,
    snapshot_key,
    token_bytes,
    tokens_of,
)
from tripod.memory.kv_pool import Pool
from tripod.memory.prefix_cache import PrefixCache
from tripod.memory.state_snapshots import StateSnapshots
from tripod.memory.tier_files import block_path

CONTENT_TYPE = "application/x-tripod-kv-blocks"


def publish_block(directory: Path, key: bytes, data: bytes | bytearray, *, snapshot: bool = False) -> bool:
    """Write one verified block into a disk tier's directory (atomically); False when it was there."""
    h = key.hex()
    final = block_path(directory, key, snapshot)
    if final.exists():
        return False
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = directory / "tmp"
    tmp_dir.mkdir(parents=True, exist_ok=True)
    # NOTE: the tier's temp-file naming, so that a tier cleans up after a receiver that died mid-write.
    tmp = tmp_dir / f"{h}.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return True


class TransferRefused(ValueError):
    """A KV stream the receiver will not take: ``status`` 409 for a sender whose model or layout
    differs (the combination cannot work), 400 for bytes that are no valid block chain."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(slots=True)
class ReceiveCounts:
    blocks: int = 0  # whole blocks verified
    published: int = 0  # of them, new in the tier (the others were there already)
    bytes: int = 0


class BlockReceiver:
    """Owns one incoming stream: splits it into blocks, verifies each (header, chain, checksum)
    and publishes it into ``directory`` (a disk tier's ``DIR/<identity>``) at once. The stream is
    one or more prefixes, each from its block 0 on."""

    def __init__(self, layout: TierLayout, directory: Path) -> None:
        self.layout = layout
        self.directory = directory
        self.counts = ReceiveCounts()
        self._buf = bytearray()
        self._prev = layout.identity  # the chain starts at the identity: block 0 first

    def feed(self, chunk: bytes) -> None:
        self._buf += chunk
        lay = self.layout
        while len(self._buf) >= HEADER.size:
            magic, ident, key, ntok, nbytes, sbytes, _crc = HEADER.unpack_from(self._buf)
            if magic != MAGIC:
                why = block_format(self._buf)
                if why is not None and why != "not a tripod KV block":
                    raise TransferRefused(409, f"the sender's KV blocks are in {why}: run one tripod version on "
                                          "prefill and decode replicas")
                raise TransferRefused(400, "not a stream of tripod KV blocks")
            if ident != lay.identity:
                raise TransferRefused(409, "the sender's KV identity (model, dtype, KV layout, quantization, --weights "
                                      "and compute path) differs from this replica's: prefill and decode replicas "
                                      "must run the same model with the same options")
            snapshot = sbytes > 0
            if snapshot:
                if sbytes != lay.state_bytes or ntok >= lay.block_tokens or nbytes != ntok * lay.token_row_bytes:
                    raise TransferRefused(409, f"the sender's state snapshot is {sbytes} bytes after {ntok} tokens, "
                                          f"this replica's {lay.state_bytes} after fewer than {lay.block_tokens}")
                size = lay.snapshot_file_bytes(ntok)
            elif ntok != lay.block_tokens or nbytes != lay.payload_bytes:
                raise TransferRefused(409, f"the sender's blocks are {ntok} tokens of {nbytes} bytes, this replica's "
                                      f"{lay.block_tokens} of {lay.payload_bytes}")
            else:
                size = lay.file_bytes
            if len(self._buf) < size:
                return
            data = bytes(self._buf[:size])
            del self._buf[:size]
            tokens = tokens_of(data, HEADER.size, ntok)
            if snapshot:
                self._snapshot(key, tokens, data)
                continue
            toks = token_bytes(tokens)
            # NOTE: a block continues the prefix sent before it, or starts another prompt's (several
            # prompts of one request, one after another); either way its key is recomputed here.
            if key != blake2b(self._prev + toks, digest_size=KEY_BYTES).digest() \
                    and key != blake2b(lay.identity + toks, digest_size=KEY_BYTES).digest():
                raise TransferRefused(400, f"block {self.counts.blocks} neither continues the prefix sent before it "
                                      "nor starts one")
            why = check_block(lay, data, key, tokens)
            if why is not None:
                raise TransferRefused(400, f"block {self.counts.blocks}: {why}")
            if publish_block(self.directory, key, data):
                self.counts.published += 1
            self.counts.blocks += 1
            self.counts.bytes += size
            self._prev = key

    def _snapshot(self, key: bytes, tail: list[int], data: bytes) -> None:
        """A snapshot block: the state after the prefix sent before it and its tail (it does not
        continue the chain; a snapshot inside block 0 follows no block)."""
        if key != snapshot_key(self._prev, tail) and key != snapshot_key(self.layout.identity, tail):
            raise TransferRefused(400, f"snapshot block {self.counts.blocks} does not follow the prefix sent before it")
        why = check_block(self.layout, data, key, tail, snapshot=True)
        if why is not None:
            raise TransferRefused(400, f"block {self.counts.blocks}: {why}")
        if publish_block(self.directory, key, data, snapshot=True):
            self.counts.published += 1
        self.counts.blocks += 1
        self.counts.bytes += len(data)

    @property
    def leftover(self) -> int:
        """Bytes of a block not received whole (a cut stream): never published."""
        return len(self._buf)


def export_prefix(cache: PrefixCache, pool: Pool, layout: TierLayout, tokens: list[int]) -> list[bytes]:
    """The whole blocks of ``tokens`` that the tree holds, from block 0 on, each as the bytes of its
    disk-tier file (``kv_transfer``: what a prefill replica sends a decode replica). Runs on the
    engine loop: nothing can evict between the match and the copies."""
    b = layout.block_tokens
    slots = cache.match_prefix(tokens, record=False).slots
    n = len(slots) // b
    if n == 0:
        return []
    keys = chain_keys(layout.identity, tokens, b, n)
    kv = pool.kv
    out: list[bytes] = []
    for at in range(0, n, COPY_BLOCKS):  # bounded copies: never the whole prompt's rows at once
        part = range(at, min(n, at + COPY_BLOCKS))
        idx = torch.tensor([s for j in part for s in slots[j * b : (j + 1) * b]], dtype=torch.long, device=kv.device)
        rows = torch.empty((kv.shape[0], len(idx), *kv.shape[2:]), dtype=kv.dtype, device=kv.device)
        for layer in range(kv.shape[0]):
            torch.index_select(kv[layer], 0, idx, out=rows[layer])
        for i, j in enumerate(part):
            out.append(encode_block(layout, keys[j], tokens[j * b : (j + 1) * b], rows[:, i * b : (i + 1) * b]))
    return out


def export_hybrid(cache: PrefixCache, pool: Pool, layout: TierLayout, snapshots: StateSnapshots | None,
                  tokens: list[int]) -> list[bytes]:
    """A hybrid model's hand-over of ``tokens``: the prefix up to the deepest node holding a state
    snapshot, as its whole blocks and then its snapshot block (the tail of tokens after them, their
    rows, the state after its last token); nothing without a snapshot (blocks alone could not resume
    it). Runs on the engine loop, like ``export_prefix``."""
    found = snapshots.find(cache.match_prefix(tokens, record=False).node) if snapshots is not None else None
    if found is None:
        return []
    assert snapshots is not None
    node, snap = found
    tokens = tokens[: len(node.path_value())]
    state = snapshots.values(snap)
    b = layout.block_tokens
    slots = cache.match_prefix(tokens, record=False).slots
    assert len(slots) == len(tokens), "a snapshot's prefix is in the tree"
    j = len(tokens) // b
    blocks = export_prefix(cache, pool, layout, tokens[: j * b])
    prev = chain_keys(layout.identity, tokens, b, j)[-1] if j else layout.identity
    kv = pool.kv
    idx = torch.tensor(slots[j * b :], dtype=torch.long, device=kv.device)
    rows = torch.empty((kv.shape[0], len(idx), *kv.shape[2:]), dtype=kv.dtype, device=kv.device)
    for layer in range(kv.shape[0]):
        torch.index_select(kv[layer], 0, idx, out=rows[layer])
    tail = tokens[j * b :]
    return [*blocks, encode_block(layout, snapshot_key(prev, tail), tail, rows, state)]
