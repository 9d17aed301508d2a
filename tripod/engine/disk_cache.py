"""The radix cache's second tier: evicted prefixes go to a ``DiskTier``, and come back from it.

- **Out.** ``RadixCache.evict`` hands the nodes it removes to ``on_evict`` before their slots are
  freed. For each, the whole blocks of the tier (``block_tokens`` tokens aligned from position 0)
  that end inside the node's edge are copied out of the pool (one ``index_select`` per layer; the
  rows of a block that starts in an ancestor's edge are still in the pool: ancestors go after
  their children) and queued for the tier's writer thread. A partial last block is not kept (at
  most ``block_tokens - 1`` tokens to recompute). ``save_tree`` does the same for every path in the
  tree (at shutdown, so a restart finds what was in the pool).
- **In.** ``load`` (called by the scheduler as it admits a request) extends the pool's longest
  match of the prompt with the blocks the tier has: it reads them (verified), allocates slots
  (evicting LRU pool entries like any admission, never the matched prefix, which it pins), copies
  the rows in and inserts the tokens into the tree, so the admission that follows matches them as
  a pool hit. ``prefetch`` (when a request is queued) starts reading those blocks in the background.
- **Identity.** ``model_identity`` digests what makes KV rows interchangeable: the model (its
  name, architecture and a sample of every weight tensor), the dtype, the pool's layout and the
  compute path; the tier keys and files everything under it.

Counters: ``hit_tokens`` (prompt tokens of first admissions served from disk: ``cached_tokens``
counts them too), ``loaded_tokens`` (every token loaded back), ``saved_tokens`` (tokens queued
for writing).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tripod.engine.lora import NAMESPACE_STRIDE
from tripod.memory.disk_tier import DiskTier, TierLayout, chain_keys
from tripod.memory.kv_transfer import encode_block

if TYPE_CHECKING:
    from tripod.engine.radix_cache import RadixCache, TreeNode
    from tripod.memory.kv_pool import Pool

log = logging.getLogger(__name__)

BLOCK_TOKENS = 16
_COPY_BLOCKS = 64  # blocks copied out of the pool at once


@dataclass(slots=True)
class DiskCacheStats:
    hit_tokens: int = 0  # prompt tokens served from the disk tier to first admissions
    loaded_tokens: int = 0  # tokens loaded back into the pool
    saved_tokens: int = 0  # tokens queued for writing (evicted, or saved at shutdown)
    load_seconds: float = 0.0  # engine-loop time spent loading (reads not prefetched, copies)
    save_seconds: float = 0.0  # engine-loop time spent copying rows out for the writer


def model_identity(*, name: str, architecture: str, model: torch.nn.Module, dtype: torch.dtype, pool: Pool,
                   extra: dict[str, Any]) -> bytes:
    """A 16-byte digest of what the KV rows depend on (see the module docstring)."""
    h = hashlib.blake2b(digest_size=16)
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


class DiskCache:
    """Connects one engine's radix cache and KV pool to a ``DiskTier`` (see the module docstring)."""

    def __init__(self, tier: DiskTier, pool: Pool) -> None:
        self.tier = tier
        self.pool = pool
        self.block = tier.layout.block_tokens
        self.stats = DiskCacheStats()

    @classmethod
    def open(cls, root: str | Path, capacity_bytes: int, pool: Pool, identity: bytes,
             block_tokens: int = BLOCK_TOKENS) -> DiskCache:
        return cls(DiskTier(root, capacity_bytes, pool_layout(pool, identity, block_tokens)), pool)

    # ------------------------------------------------------------------ rows
    def _copy_out(self, slots: list[int]) -> torch.Tensor:
        """``[layers, len(slots), *row]``: a copy of these slots' rows."""
        kv = self.pool.kv
        idx = torch.tensor(slots, dtype=torch.long, device=kv.device)
        out = torch.empty((kv.shape[0], len(slots), *kv.shape[2:]), dtype=kv.dtype, device=kv.device)
        for layer in range(kv.shape[0]):
            torch.index_select(kv[layer], 0, idx, out=out[layer])
        return out

    def _copy_in(self, slots: list[int], rows: torch.Tensor) -> None:
        kv = self.pool.kv
        idx = torch.tensor(slots, dtype=torch.long, device=kv.device)
        rows = rows.to(kv.device)
        for layer in range(kv.shape[0]):
            kv[layer].index_copy_(0, idx, rows[layer])

    # ------------------------------------------------------------------ out
    def on_evict(self, nodes: list[TreeNode]) -> None:
        """Queue the whole blocks ending in each removed node's edge (their slots not yet freed)."""
        t0 = time.perf_counter()
        for node in nodes:
            tokens, slots = _path(node)
            self._save(tokens, slots, len(tokens) - len(node.key))
        self.stats.save_seconds += time.perf_counter() - t0

    def save_tree(self, cache: RadixCache, timeout: float | None = None) -> None:
        """Queue every block of every path in the tree that the tier does not have (``timeout``:
        wait for room in the write queue up to that many seconds in all, instead of dropping)."""
        t0 = time.perf_counter()
        deadline = None if timeout is None else time.monotonic() + timeout
        for node in cache.tree.leaves():
            tokens, slots = _path(node)
            self._save(tokens, slots, 0, deadline)
        self.stats.save_seconds += time.perf_counter() - t0

    def _save(self, tokens: list[int], slots: list[int], start: int, deadline: float | None = None) -> None:
        if not _tiered(tokens):
            return
        b = self.block
        first, end = start // b, len(tokens) // b
        if end <= first:
            return
        keys = chain_keys(self.tier.layout.identity, tokens, b, end)
        todo = [j for j in range(first, end) if not self.tier.known(keys[j])]
        per_block = self.tier.layout.payload_bytes
        for at in range(0, len(todo), _COPY_BLOCKS):  # bounded copies: never the whole path at once
            part = todo[at : at + _COPY_BLOCKS]
            need = len(part) * per_block
            if not self.tier.has_room(need) and (deadline is None or not self.tier.wait_for_room(need, deadline)):
                # NOTE: the queue stays full while the disk is slower than eviction: drop (counted).
                self.tier.count_dropped(len(part))
                continue
            rows = self._copy_out([s for j in part for s in slots[j * b : (j + 1) * b]])
            for i, j in enumerate(part):
                if self.tier.submit(keys[j], tokens[j * b : (j + 1) * b], rows[:, i * b : (i + 1) * b]):
                    self.stats.saved_tokens += b

    # ------------------------------------------------------------------ in
    def _missing_blocks(self, cache: RadixCache, tokens: list[int]) -> tuple[int, list[bytes]]:
        """(tokens the pool has, the keys of the blocks from the one holding the next token on)."""
        if not _tiered(tokens):
            return 0, []
        hit = len(cache.match_prefix(tokens, record=False).slots)
        end = len(tokens) // self.block
        if hit // self.block >= end:
            return hit, []
        return hit, chain_keys(self.tier.layout.identity, tokens, self.block, end)[hit // self.block :]

    def prefetch(self, cache: RadixCache, tokens: list[int]) -> None:
        """Start reading the blocks that extend the pool's match of ``tokens`` (a queued request)."""
        hit, keys = self._missing_blocks(cache, tokens)
        n = self.tier.count_present(keys)
        if n:
            b, first = self.block, hit // self.block
            self.tier.prefetch(keys[:n], [tokens[(first + i) * b : (first + i + 1) * b] for i in range(n)])

    def load(self, cache: RadixCache, tokens: list[int], *, headroom: int, chunk: int, record: bool) -> int:
        """Extend the pool's match of ``tokens`` (a prompt but its last token) with the tier's
        blocks, leaving room for ``headroom`` slots and the first prefill chunk after them (at most
        ``chunk`` tokens); returns how many tokens were loaded (now in the tree, unpinned)."""
        hit, keys = self._missing_blocks(cache, tokens)
        n = self.tier.count_present(keys)
        if n == 0:
            return 0
        t0 = time.perf_counter()
        b, first = self.block, hit // self.block
        match = cache.match_prefix(tokens[:hit], record=False)
        cache.lock(match.node)  # eviction below must not take the prefix we extend
        try:
            alloc = cache.allocator

            def need(blocks: int) -> int:  # slots for the loaded rows, the next chunk and the headroom
                covered = (first + blocks) * b
                return covered - hit + min(chunk, len(tokens) + 1 - covered) + headroom

            if alloc.num_free < need(n):
                cache.evict(need(n) - alloc.num_free)
            while n > 0 and need(n) > alloc.num_free:
                n -= 1
            if n <= 0:
                return 0
            blocks = self.tier.read(keys[:n], [tokens[(first + i) * b : (first + i + 1) * b] for i in range(n)])
            if not blocks:
                return 0
            count = (first + len(blocks)) * b - hit
            slots = alloc.alloc(count)
            assert slots is not None
            rows = blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=1)
            self._copy_in(slots, rows[:, hit - first * b :])
            present, _ = cache.insert(tokens[: hit + count], match.slots + slots)
            assert present == hit, f"the tree changed under a disk load ({present} != {hit})"
        finally:
            cache.unlock(match.node)
        self.stats.loaded_tokens += count
        if record:
            self.stats.hit_tokens += count
        self.stats.load_seconds += time.perf_counter() - t0
        return count

    def close(self, cache: RadixCache | None, timeout: float = 8.0) -> None:
        """Save the tree (when given), publish what is queued (up to ``timeout`` s), stop."""
        deadline = time.monotonic() + timeout
        if cache is not None:
            self.save_tree(cache, timeout)
        if not self.tier.close(max(0.0, deadline - time.monotonic())):
            log.warning("kv disk tier: %d bytes of blocks were not written in %.0f s at shutdown",
                        self.tier.pending_bytes, timeout)


def pool_layout(pool: Pool, identity: bytes, block_tokens: int = BLOCK_TOKENS) -> TierLayout:
    """The block layout of ``pool``'s rows under ``identity`` (the disk tier's and the KV transfer's)."""
    kv = pool.kv
    return TierLayout(identity, kv.shape[0], tuple(kv.shape[2:]), kv.dtype, block_tokens)


def export_prefix(cache: RadixCache, pool: Pool, layout: TierLayout, tokens: list[int]) -> list[bytes]:
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
    for at in range(0, n, _COPY_BLOCKS):  # bounded copies: never the whole prompt's rows at once
        part = range(at, min(n, at + _COPY_BLOCKS))
        idx = torch.tensor([s for j in part for s in slots[j * b : (j + 1) * b]], dtype=torch.long, device=kv.device)
        rows = torch.empty((kv.shape[0], len(idx), *kv.shape[2:]), dtype=kv.dtype, device=kv.device)
        for layer in range(kv.shape[0]):
            torch.index_select(kv[layer], 0, idx, out=rows[layer])
        for i, j in enumerate(part):
            out.append(encode_block(layout, keys[j], tokens[j * b : (j + 1) * b], rows[:, i * b : (i + 1) * b]))
    return out


def _path(node: TreeNode) -> tuple[list[int], list[int]]:
    """The tokens and slots from the root to ``node`` (which may just have been detached)."""
    keys: list[list[int]] = []
    values: list[list[int]] = []
    n: TreeNode | None = node
    while n is not None and n.parent is not None:
        keys.append(n.key)
        values.append(n.value)
        n = n.parent
    tokens = [t for k in reversed(keys) for t in k]
    slots = [s for v in reversed(values) for s in v]
    return tokens, slots


def _tiered(tokens: list[int]) -> bool:
    """Whether a radix key's blocks go to the tier: a LoRA adapter's prefix (its key in the adapter's
    namespace, ``engine/lora.py``) stays in the pool only; the tier's identity has no adapter in it."""
    return not tokens or tokens[0] < NAMESPACE_STRIDE
