"""A token-level radix tree over KV slots: the pool's prefix cache (a ``PrefixCache``).

Each edge holds a run of token ids and the KV slots that hold their K/V. A path from the root
spells a token prefix whose KV is resident, so a new request whose prompt starts with that
prefix skips computing it. The locking and ownership rules are the protocol's
(``prefix_cache.py``); a parent whose last child is evicted becomes a leaf candidate.

With data-parallel attention there is one tree per rank (each over its rank's slot range). A
cache below it (``tiered_cache.TieredCache``) hears of every evicted node through ``on_evict``,
called before the node's slots are freed, so it can copy their rows out.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

from tripod.memory.kv_pool import SlotAllocator
from tripod.memory.prefix_cache import CacheStats, MatchResult, TreeNode
from tripod.memory.radix import RadixTree

_tick = itertools.count()


class RadixCache:
    """The pool's prefix cache. Owns the trees (``tripod.memory.radix.RadixTree`` over token ids,
    the slots as their payload) and the slots stored in them (see the module docstring).
    ``on_evict``: told of the nodes each eviction removes, before their slots are freed."""

    def __init__(self, allocator: SlotAllocator, enabled: bool = True, *,
                 on_evict: Callable[[list[TreeNode]], None] | None = None) -> None:
        self.allocator = allocator
        self.enabled = enabled
        self.trees: list[RadixTree[list[int]]] = [RadixTree([]) for _ in range(allocator.ranks)]
        self.tree = self.trees[0]
        for tree in self.trees:
            tree.root.lock_ref = 1  # a root is never evicted
        self.stats = CacheStats()
        self._protected = 0  # slots held by pinned nodes
        self._on_evict = on_evict

    @property
    def root(self) -> TreeNode:
        return self.tree.root

    # ---------------------------------------------------------------- sizes
    @property
    def total_size(self) -> int:
        return sum(t.size for t in self.trees)

    @property
    def evictable_size(self) -> int:
        return self.total_size - self._protected

    @property
    def protected_size(self) -> int:
        return self._protected

    # ---------------------------------------------------------------- match
    def match_prefix(self, tokens: list[int], *, record: bool = True, rank: int | None = None) -> MatchResult:
        """Longest cached prefix of ``tokens`` (in ``rank``'s tree; None: the longest over every
        rank). Splits an edge so the result ends on a node."""
        if record:
            self.stats.queries += 1
            self.stats.query_tokens += len(tokens)
        if not self.enabled or not tokens:
            return MatchResult([], self.trees[rank or 0].root, rank or 0)
        best: MatchResult | None = None
        for r in range(len(self.trees)) if rank is None else (rank,):
            _, node = self.trees[r].match(tokens, now=next(_tick))
            found = MatchResult(node.path_value(), node, r)
            if best is None or len(found.slots) > len(best.slots):
                best = found
        assert best is not None
        if record:
            self.stats.hit_tokens += len(best.slots)
        return best

    def record(self, query_tokens: int, hit_tokens: int) -> None:
        """Count one lookup made with ``record=False`` (a choice among ranks' trees)."""
        self.stats.queries += 1
        self.stats.query_tokens += query_tokens
        self.stats.hit_tokens += hit_tokens

    # ---------------------------------------------------------------- insert
    def insert(self, tokens: list[int], slots: list[int]) -> tuple[int, TreeNode]:
        """Store ``tokens``→``slots``. Returns (tokens already present, node ending the path).

        The caller still owns ``slots[:present]`` (they duplicate the tree's, or are the
        tree's own if the caller got them from ``match_prefix``) and must free any that are
        its private copies.
        """
        assert len(tokens) == len(slots)
        tree = self.trees[self.allocator.rank_of(slots[0])] if slots else self.tree
        if not self.enabled or not tokens:
            return 0, tree.root
        return tree.insert(tokens, next(_tick), slots)

    # ---------------------------------------------------------------- locks
    def lock(self, node: TreeNode) -> None:
        while node.parent is not None:  # up to (not including) its tree's root
            if node.lock_ref == 0:
                self._protected += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        while node.parent is not None:
            assert node.lock_ref > 0, "unlock of an unlocked radix node"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._protected -= len(node.key)
            node = node.parent  # type: ignore[assignment]

    # ---------------------------------------------------------------- evict
    def evict(self, num_tokens: int, rank: int | None = None) -> int:
        """Free at least ``num_tokens`` slots from unpinned LRU leaves, if possible (of ``rank``'s
        range only; None: of any)."""
        freed = 0
        for r in range(len(self.trees)) if rank is None else (rank,):
            nodes = self.trees[r].evict(num_tokens - freed)
            if self._on_evict is not None and nodes:
                self._on_evict(nodes)  # (a tier copies their rows out before the slots are freed)
            for node in nodes:
                self.allocator.free(node.value)
                freed += len(node.value)
            if freed >= num_tokens:
                break
        self.stats.evicted_tokens += freed
        return freed

    def reset(self) -> None:
        """Drop every unpinned entry (e.g. between benchmark runs)."""
        self.evict(self.evictable_size)

    # ---------------------------------------------------------------- tiers (none below the pool)
    def prefetch(self, tokens: list[int]) -> None:
        """Nothing below the pool to read from."""

    def load(self, tokens: list[int], *, headroom: int, chunk: int, record: bool) -> int:
        """Nothing below the pool to load from."""
        return 0

    def close(self) -> None:
        """Nothing outlives the pool."""

    # ---------------------------------------------------------------- checks
    def slots_in_tree(self) -> list[int]:
        return [s for tree in self.trees for n in tree.nodes() for s in n.value]

    def check_tree(self) -> None:
        """Structural invariants of the trees alone (sizes, locks, keys, each tree on its rank)."""
        protected = 0
        for rank, tree in enumerate(self.trees):
            protected += self._check(tree, rank)
        assert protected == self._protected, f"pinned {protected} != counter {self._protected}"

    def _check(self, tree: RadixTree[list[int]], rank: int) -> int:
        total = protected = 0
        for n in tree.nodes():
            if n is not tree.root:
                assert n.key and len(n.key) == len(n.value), "edge without tokens or slot count off"
                assert all(self.allocator.rank_of(s) == rank for s in n.value), f"a slot off rank {rank}'s range"
                assert n.parent is not None and n.parent.children.get(n.key[0]) is n
                total += len(n.key)
                if n.lock_ref > 0:
                    protected += len(n.key)
                assert n.lock_ref >= sum(c.lock_ref for c in n.children.values()), (
                    "a child is locked more than its parent"
                )
            for first, c in n.children.items():
                assert c.key[0] == first
        assert total == tree.size, f"tree size {total} != counter {tree.size}"
        return protected
