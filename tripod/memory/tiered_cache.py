"""The radix cache with a second tier under it: evicted prefixes go to a ``DiskTier``, and come back.

``TieredCache`` is a ``PrefixCache`` (``prefix_cache.py``) that wraps a ``RadixCache``: every
match, lock, insert and eviction is the radix cache's; what it adds is the tier.

- **Out.** The radix cache reports the nodes each eviction removes (its ``on_evict``) before their
  slots are freed. For each, the whole blocks of the tier (``block_tokens`` tokens aligned from
  position 0) that end inside the node's edge are copied out of the pool (one ``index_select`` per
  layer; the rows of a block that starts in an ancestor's edge are still in the pool: ancestors go
  after their children) and queued for the tier's writer thread. A partial last block is not kept
  (at most ``block_tokens - 1`` tokens to recompute). ``save_tree`` does the same for every path in
  the tree (``close``, at shutdown: a restart finds what was in the pool).
- **In.** ``load`` (the scheduler's, as it admits a request) extends the pool's longest match of the
  prompt with the blocks the tier has: it reads them (verified), allocates slots (evicting LRU pool
  entries like any admission, never the matched prefix, which it pins), copies the rows in and
  inserts the tokens into the tree, so the admission that follows matches them as a pool hit.
  ``prefetch`` (when a request is queued) starts reading those blocks in the background.
- **Hybrid models.** A linear-attention model's prefix resumes only where a recurrent-state snapshot
  is (``state_snapshots``): this cache owns the snapshot store over its tree. A node evicted with a
  snapshot, and at ``close`` every node holding one, also writes a *snapshot block* (``kv_blocks``:
  the state and the tail of tokens after the last whole block, keyed by the prefix). ``load`` then
  looks, deepest first, for a snapshot block beyond the pool's deepest snapshot whose whole blocks
  the pool or the tier has; it loads those blocks, the tail and the state onto the node ending
  there, which the admission's match resumes from. Blocks without a snapshot are not loaded for a
  hybrid (they could not resume it). The search hashes one candidate position per token between the
  pool's snapshot and the tier's coverage, in memory (no file system call but for the prompt's own
  end, where a KV transfer's receiver publishes), and only while the tier knows any snapshot block.
- **Identity.** The tier is keyed by ``kv_blocks.model_identity`` (model, dtype, pool layout,
  compute path); a LoRA adapter's prefixes (keys outside the base namespace) stay in the pool.

Counters (``tier_stats``): ``hit_tokens`` (prompt tokens of first admissions served from disk:
``cached_tokens`` counts them too), ``loaded_tokens`` (every token loaded back), ``saved_tokens``
(tokens queued for writing).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from tripod.memory.disk_tier import DiskTier
from tripod.memory.kv_blocks import (
    BLOCK_TOKENS,
    COPY_BLOCKS,
    TierLayout,
    chain_keys,
    pool_layout,
    snapshot_key,
)
from tripod.memory.kv_pool import Pool, SlotAllocator
from tripod.memory.prefix_cache import CacheStats, MatchResult, TreeNode, in_base_namespace
from tripod.memory.radix import RadixTree
from tripod.memory.radix_cache import RadixCache
from tripod.memory.state_snapshots import StateSnapshots
from tripod.protocol.engine_ipc import KVTierCard
from tripod.protocol.stats import DiskTierStats

log = logging.getLogger(__name__)


@dataclass(slots=True)
class TieredCacheStats:
    hit_tokens: int = 0  # prompt tokens served from the disk tier to first admissions
    loaded_tokens: int = 0  # tokens loaded back into the pool
    saved_tokens: int = 0  # tokens queued for writing (evicted, or saved at shutdown)
    load_seconds: float = 0.0  # engine-loop time spent loading (reads not prefetched, copies)
    save_seconds: float = 0.0  # engine-loop time spent copying rows out for the writer
    saved_snapshots: int = 0  # snapshot blocks queued for writing (hybrid models)
    loaded_snapshots: int = 0  # snapshot blocks loaded back onto a tree node


# Makes the snapshot store over a tree (its argument gives the tree's current root).
SnapshotMaker = Callable[[Callable[[], TreeNode]], "StateSnapshots | None"]


class TieredCache:
    """One engine's prefix cache over its KV pool and a ``DiskTier`` below it (see the module
    docstring). Owns the radix cache (``radix``) and the tier's traffic; the tier owns its files."""

    def __init__(self, allocator: SlotAllocator, pool: Pool, tier: DiskTier, *, enabled: bool = True,
                 snapshots: SnapshotMaker | None = None) -> None:
        self.pool = pool
        self.tier = tier
        self.block = tier.layout.block_tokens
        self.tier_stats = TieredCacheStats()
        self.radix = RadixCache(allocator, enabled, on_evict=self._save_evicted)
        self.allocator = allocator
        self.enabled = enabled
        self.stats: CacheStats = self.radix.stats
        # A hybrid model's state snapshots on this tree (None: a model without linear layers, or none kept).
        self.snapshots = snapshots(lambda: self.radix.tree.root) if snapshots is not None and enabled else None
        self.hybrid = tier.layout.state_bytes > 0

    @classmethod
    def open(cls, root: str | Path, capacity_bytes: int, pool: Pool, identity: bytes, *, enabled: bool = True,
             block_tokens: int = BLOCK_TOKENS, state_bytes: int = 0,
             snapshots: SnapshotMaker | None = None) -> TieredCache:
        tier = DiskTier(root, capacity_bytes, pool_layout(pool, identity, block_tokens, state_bytes))
        return cls(pool.allocator, pool, tier, enabled=enabled, snapshots=snapshots)

    @property
    def layout(self) -> TierLayout:
        return self.tier.layout

    def card(self) -> KVTierCard:
        """Where and how the tier keeps blocks (the engine's ``Ready``: a decode replica's HTTP
        process publishes received blocks there)."""
        lay = self.tier.layout
        return KVTierCard(dir=str(self.tier.dir), identity=lay.identity.hex(), num_layers=lay.num_layers,
                          row_shape=list(lay.row_shape), dtype=str(lay.dtype).removeprefix("torch."),
                          block_tokens=lay.block_tokens, state_bytes=lay.state_bytes)

    def report(self) -> DiskTierStats:
        """The tier's part of the engine's stats snapshot."""
        t, c, d = self.tier, self.tier.counters, self.tier_stats
        return DiskTierStats(
            dir=str(t.dir), capacity_bytes=t.capacity_bytes, used_bytes=t.used_bytes, entries=t.entries,
            block_tokens=self.block, hit_tokens=d.hit_tokens, loaded_tokens=d.loaded_tokens,
            saved_tokens=d.saved_tokens, written_blocks=c.written_blocks, written_bytes=c.written_bytes,
            dropped_blocks=c.dropped_blocks, read_blocks=c.read_blocks, prefetched_blocks=c.prefetched_blocks,
            corrupt_files=c.corrupt_files, evicted_files=c.evicted_files, load_seconds=d.load_seconds,
            save_seconds=d.save_seconds)

    # ------------------------------------------------------------------ the radix cache's
    @property
    def tree(self) -> RadixTree[list[int]]:
        return self.radix.tree

    @property
    def root(self) -> TreeNode:
        return self.radix.root

    @property
    def total_size(self) -> int:
        return self.radix.total_size

    @property
    def evictable_size(self) -> int:
        return self.radix.evictable_size

    @property
    def protected_size(self) -> int:
        return self.radix.protected_size

    def match_prefix(self, tokens: list[int], *, record: bool = True, rank: int | None = None) -> MatchResult:
        return self.radix.match_prefix(tokens, record=record, rank=rank)

    def record(self, query_tokens: int, hit_tokens: int) -> None:
        self.radix.record(query_tokens, hit_tokens)

    def lock(self, node: TreeNode) -> None:
        self.radix.lock(node)

    def unlock(self, node: TreeNode) -> None:
        self.radix.unlock(node)

    def insert(self, tokens: list[int], slots: list[int]) -> tuple[int, TreeNode]:
        return self.radix.insert(tokens, slots)

    def evict(self, num_tokens: int, rank: int | None = None) -> int:
        return self.radix.evict(num_tokens, rank)  # (the evicted nodes' blocks: _save_evicted)

    def reset(self) -> None:
        self.radix.reset()

    def slots_in_tree(self) -> list[int]:
        return self.radix.slots_in_tree()

    def check_tree(self) -> None:
        self.radix.check_tree()

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
    def _save_evicted(self, nodes: list[TreeNode]) -> None:
        """Queue the whole blocks ending in each removed node's edge (their slots not yet freed)."""
        t0 = time.perf_counter()
        for node in nodes:
            tokens, slots = _path(node)
            self._save(tokens, slots, len(tokens) - len(node.key))
            snap = self.snapshots.slot_of(node) if self.snapshots is not None else None
            if snap is not None:
                self._save_snapshot(tokens, slots, snap)
        self.tier_stats.save_seconds += time.perf_counter() - t0

    def save_tree(self, timeout: float | None = None) -> None:
        """Queue every block of every path in the tree that the tier does not have (``timeout``:
        wait for room in the write queue up to that many seconds in all, instead of dropping)."""
        t0 = time.perf_counter()
        deadline = None if timeout is None else time.monotonic() + timeout
        for node in self.radix.tree.leaves():
            tokens, slots = _path(node)
            self._save(tokens, slots, 0, deadline)
        for node in self.snapshots.held() if self.snapshots is not None else ():
            snap = self.snapshots.slot_of(node)
            assert snap is not None
            tokens, slots = _path(node)
            self._save_snapshot(tokens, slots, snap, deadline)
        self.tier_stats.save_seconds += time.perf_counter() - t0

    def _save(self, tokens: list[int], slots: list[int], start: int, deadline: float | None = None) -> None:
        if not in_base_namespace(tokens):
            return
        b = self.block
        first, end = start // b, len(tokens) // b
        if end <= first:
            return
        keys = chain_keys(self.tier.layout.identity, tokens, b, end)
        todo = [j for j in range(first, end) if not self.tier.known(keys[j])]
        per_block = self.tier.layout.payload_bytes
        for at in range(0, len(todo), COPY_BLOCKS):  # bounded copies: never the whole path at once
            part = todo[at : at + COPY_BLOCKS]
            need = len(part) * per_block
            if not self.tier.has_room(need) and (deadline is None or not self.tier.wait_for_room(need, deadline)):
                # NOTE: the queue stays full while the disk is slower than eviction: drop (counted).
                self.tier.count_dropped(len(part))
                continue
            rows = self._copy_out([s for j in part for s in slots[j * b : (j + 1) * b]])
            for i, j in enumerate(part):
                if self.tier.submit(keys[j], tokens[j * b : (j + 1) * b], rows[:, i * b : (i + 1) * b]):
                    self.tier_stats.saved_tokens += b

    def _save_snapshot(self, tokens: list[int], slots: list[int], snap: int, deadline: float | None = None) -> None:
        """Queue the snapshot block of the prefix ``tokens`` (its state: snapshot slot ``snap``)."""
        if not in_base_namespace(tokens) or self.snapshots is None:
            return
        b, lay = self.block, self.tier.layout
        j = len(tokens) // b
        prev = chain_keys(lay.identity, tokens, b, j)[-1] if j else lay.identity
        key = snapshot_key(prev, tokens[j * b :])
        if self.tier.has_snapshot(key):
            return
        need = (len(tokens) - j * b) * lay.token_row_bytes + lay.state_bytes
        if not self.tier.has_room(need) and (deadline is None or not self.tier.wait_for_room(need, deadline)):
            self.tier.count_dropped(1)
            return
        rows = self._copy_out(slots[j * b :])
        if self.tier.submit(key, tokens[j * b :], rows, self.snapshots.values(snap)):
            self.tier_stats.saved_snapshots += 1

    # ------------------------------------------------------------------ in
    def _missing_blocks(self, tokens: list[int]) -> tuple[int, list[bytes]]:
        """(tokens the pool has, the keys of the blocks from the one holding the next token on)."""
        if not in_base_namespace(tokens):
            return 0, []
        hit = len(self.radix.match_prefix(tokens, record=False).slots)
        end = len(tokens) // self.block
        if hit // self.block >= end:
            return hit, []
        return hit, chain_keys(self.tier.layout.identity, tokens, self.block, end)[hit // self.block :]

    def prefetch(self, tokens: list[int]) -> None:
        """Start reading the blocks that extend the pool's match of ``tokens`` (a queued request)."""
        hit, keys = self._missing_blocks(tokens)
        n = self.tier.count_present(keys)
        if n:
            b, first = self.block, hit // self.block
            self.tier.prefetch(keys[:n], [tokens[(first + i) * b : (first + i + 1) * b] for i in range(n)])

    def load(self, tokens: list[int], *, headroom: int, chunk: int, record: bool) -> int:
        """Extend the pool's match of ``tokens`` (a prompt but its last token) with the tier's
        blocks, leaving room for ``headroom`` slots and the first prefill chunk after them (at most
        ``chunk`` tokens); returns how many tokens were loaded (now in the tree, unpinned)."""
        if self.hybrid:
            return self._load_snapshot(tokens, headroom=headroom, chunk=chunk, record=record)
        hit, keys = self._missing_blocks(tokens)
        n = self.tier.count_present(keys)
        if n == 0:
            return 0
        cache = self.radix
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
        self.tier_stats.loaded_tokens += count
        if record:
            self.tier_stats.hit_tokens += count
        self.tier_stats.load_seconds += time.perf_counter() - t0
        return count

    def _load_snapshot(self, tokens: list[int], *, headroom: int, chunk: int, record: bool) -> int:
        """A hybrid model's ``load``: the deepest snapshot block beyond the pool's deepest snapshot
        whose whole blocks the pool or the tier holds, with those blocks (see the module docstring)."""
        snaps = self.snapshots
        if snaps is None or not tokens or not in_base_namespace(tokens):
            return 0
        lay, b = self.tier.layout, self.block
        match = self.radix.match_prefix(tokens, record=False)
        hit = len(match.slots)
        found = snaps.find(match.node)
        depth = len(found[0].path_value()) if found is not None else 0
        keys = chain_keys(lay.identity, tokens, b)
        first = hit // b
        cover = max(hit, (first + self.tier.count_present(keys[first:])) * b)
        for p in range(min(len(tokens), cover // b * b + b - 1), depth, -1):
            if p != len(tokens) and not self.tier.snapshot_entries:
                break  # (no snapshot block known: only the prompt's own end is looked for on disk)
            j = p // b
            key = snapshot_key(keys[j - 1] if j else lay.identity, tokens[j * b : p])
            if self.tier.has_snapshot(key, probe=p == len(tokens)):
                return self._resume(tokens, keys, match, p, key, headroom=headroom, chunk=chunk, record=record)
        return 0

    def _resume(self, tokens: list[int], keys: list[bytes], match: MatchResult, p: int, key: bytes, *,
                headroom: int, chunk: int, record: bool) -> int:
        """Load the prefix ``tokens[:p]`` beyond the pool's ``match`` (whole blocks and the snapshot
        block ``key``'s tail) and put its state on the node ending at ``p``; tokens loaded."""
        assert self.snapshots is not None
        cache, alloc, b = self.radix, self.allocator, self.block
        t0 = time.perf_counter()
        hit, j = len(match.slots), p // b
        count = max(0, p - hit)
        cache.lock(match.node)  # eviction below must not take the prefix we extend
        try:
            need = count + min(chunk, len(tokens) + 1 - p) + headroom
            if alloc.num_free < need:
                cache.evict(need - alloc.num_free)
            if alloc.num_free < need:
                return 0
            snap = self.tier.read_snapshot(key, tokens[j * b : p])
            if snap is None:
                return 0
            tail, state = snap
            if count:
                first = hit // b
                blocks = self.tier.read(keys[first:j], [tokens[i * b : (i + 1) * b] for i in range(first, j)])
                if len(blocks) < j - first:
                    return 0  # a block went missing meanwhile: the prefix cannot be resumed
                rows = torch.cat([*blocks, tail.to(blocks[0].device)], dim=1) if blocks else tail
                slots = alloc.alloc(count)
                assert slots is not None
                self._copy_in(slots, rows[:, hit - first * b :])
                present, node = cache.insert(tokens[:p], match.slots + slots)
                assert present == hit, f"the tree changed under a disk load ({present} != {hit})"
            else:  # the pool has the rows; only the state was missing
                node = cache.match_prefix(tokens[:p], record=False).node
            self.snapshots.put_values(node, state)
        finally:
            cache.unlock(match.node)
        d = self.tier_stats
        d.loaded_tokens += count
        d.loaded_snapshots += 1
        if record:
            d.hit_tokens += count
        d.load_seconds += time.perf_counter() - t0
        return count

    def close(self, timeout: float = 8.0) -> None:
        """Save the tree, publish what is queued (up to ``timeout`` s), stop the tier's threads."""
        deadline = time.monotonic() + timeout
        self.save_tree(timeout)
        if not self.tier.close(max(0.0, deadline - time.monotonic())):
            log.warning("kv disk tier: %d bytes of blocks were not written in %.0f s at shutdown",
                        self.tier.pending_bytes, timeout)


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
