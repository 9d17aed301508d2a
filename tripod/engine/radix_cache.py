"""A token-level radix tree over KV slots: the prefix cache.

Each edge holds a run of token ids and the KV slots that hold their K/V. A path from the root
spells a token prefix whose KV is resident, so a new request whose prompt starts with that
prefix skips computing it.

Locking rules:
- ``lock(node)`` pins ``node`` and every ancestor (lock_ref += 1). A running request holds one
  lock on the deepest node of its cached prefix; ``unlock`` releases it. Pinned nodes are never
  evicted.
- ``evict(n)`` frees the slots of least-recently-used *unpinned leaves* until ``n`` slots are
  freed or nothing evictable remains; a parent whose last child goes becomes a leaf candidate.
- ``insert`` takes ownership of the slots it stores. Where a prefix of the inserted tokens is
  already in the tree, the caller's duplicate slots are *not* taken: ``insert`` returns how
  many leading tokens were already present so the caller frees its copies of them.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from tripod.memory.kv_pool import SlotAllocator

_tick = itertools.count()


@dataclass(slots=True, eq=False)
class TreeNode:
    key: list[int] = field(default_factory=list)  # token ids on the edge into this node
    value: list[int] = field(default_factory=list)  # KV slots of those tokens
    parent: TreeNode | None = None
    children: dict[int, TreeNode] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = 0  # a logical clock; larger is more recent

    def __repr__(self) -> str:
        return f"TreeNode(len={len(self.key)}, lock={self.lock_ref}, kids={len(self.children)})"


@dataclass(slots=True)
class MatchResult:
    slots: list[int]  # KV slots of the matched prefix
    node: TreeNode  # deepest node covering exactly the matched prefix (root if none)


@dataclass(slots=True)
class CacheStats:
    queries: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    evicted_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


class RadixCache:
    """The prefix cache. Owns the tree and the slots stored in it (see module docstring)."""

    def __init__(self, allocator: SlotAllocator, enabled: bool = True) -> None:
        self.allocator = allocator
        self.enabled = enabled
        self.root = TreeNode()
        self.root.lock_ref = 1  # the root is never evicted
        self.stats = CacheStats()
        self._total = 0  # slots held by the tree
        self._protected = 0  # slots held by pinned nodes

    # ---------------------------------------------------------------- sizes
    @property
    def total_size(self) -> int:
        return self._total

    @property
    def evictable_size(self) -> int:
        return self._total - self._protected

    @property
    def protected_size(self) -> int:
        return self._protected

    # ---------------------------------------------------------------- match
    def match_prefix(self, tokens: list[int], *, record: bool = True) -> MatchResult:
        """Longest cached prefix of ``tokens``. Splits an edge so the result ends on a node."""
        if record:
            self.stats.queries += 1
            self.stats.query_tokens += len(tokens)
        if not self.enabled or not tokens:
            return MatchResult([], self.root)
        node = self.root
        slots: list[int] = []
        pos = 0
        now = next(_tick)
        node.last_access = now
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                break
            n = _common_len(child.key, tokens, pos)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            slots.extend(child.value)
            pos += n
            node = child
        if record:
            self.stats.hit_tokens += len(slots)
        return MatchResult(slots, node)

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Split ``child``'s edge after ``n`` tokens; returns the new upper node."""
        assert 0 < n < len(child.key)
        parent = child.parent
        assert parent is not None
        upper = TreeNode(
            key=child.key[:n],
            value=child.value[:n],
            parent=parent,
            lock_ref=child.lock_ref,
            last_access=child.last_access,
        )
        # NOTE: lock refs count per path, so the upper half inherits the child's lock count;
        # protected/total sizes do not change (the same slots, now on two nodes).
        parent.children[upper.key[0]] = upper
        child.key = child.key[n:]
        child.value = child.value[n:]
        child.parent = upper
        upper.children[child.key[0]] = child
        return upper

    # ---------------------------------------------------------------- insert
    def insert(self, tokens: list[int], slots: list[int]) -> tuple[int, TreeNode]:
        """Store ``tokens``→``slots``. Returns (tokens already present, node ending the path).

        The caller still owns ``slots[:present]`` (they duplicate the tree's, or are the
        tree's own if the caller got them from ``match_prefix``) and must free any that are
        its private copies.
        """
        assert len(tokens) == len(slots)
        if not self.enabled or not tokens:
            return 0, self.root
        node = self.root
        pos = 0
        now = next(_tick)
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                new = TreeNode(
                    key=list(tokens[pos:]), value=list(slots[pos:]), parent=node, last_access=now
                )
                node.children[tokens[pos]] = new
                self._total += len(new.key)
                return pos, new
            n = _common_len(child.key, tokens, pos)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            pos += n
            node = child
        return pos, node

    # ---------------------------------------------------------------- locks
    def lock(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self._protected += len(node.key)
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]

    def unlock(self, node: TreeNode) -> None:
        while node is not self.root:
            assert node.lock_ref > 0, "unlock of an unlocked radix node"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._protected -= len(node.key)
            node = node.parent  # type: ignore[assignment]

    # ---------------------------------------------------------------- evict
    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` slots from unpinned LRU leaves, if possible."""
        if num_tokens <= 0:
            return 0
        heap = [(n.last_access, id(n), n) for n in self._leaves() if n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            assert parent is not None and node.lock_ref == 0 and not node.children
            self.allocator.free(node.value)
            freed += len(node.value)
            self._total -= len(node.key)
            del parent.children[node.key[0]]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        self.stats.evicted_tokens += freed
        return freed

    def _leaves(self) -> list[TreeNode]:
        out: list[TreeNode] = []
        stack = [self.root]
        while stack:
            n = stack.pop()
            if not n.children and n is not self.root:
                out.append(n)
            stack.extend(n.children.values())
        return out

    def reset(self) -> None:
        """Drop every unpinned entry (e.g. between benchmark runs)."""
        self.evict(self.evictable_size)

    # ---------------------------------------------------------------- checks
    def slots_in_tree(self) -> list[int]:
        out: list[int] = []
        stack = [self.root]
        while stack:
            n = stack.pop()
            out.extend(n.value)
            stack.extend(n.children.values())
        return out

    def check_tree(self) -> None:
        """Structural invariants of the tree alone (sizes, locks, keys)."""
        total = protected = 0
        stack = [self.root]
        while stack:
            n = stack.pop()
            if n is not self.root:
                assert n.key and len(n.key) == len(n.value), "edge without tokens or slot count off"
                assert n.parent is not None and n.parent.children.get(n.key[0]) is n
                total += len(n.key)
                if n.lock_ref > 0:
                    protected += len(n.key)
                assert n.lock_ref >= sum(c.lock_ref for c in n.children.values()), (
                    "a child is locked more than its parent"
                )
            for first, c in n.children.items():
                assert c.key[0] == first
            stack.extend(n.children.values())
        assert total == self._total, f"tree size {total} != counter {self._total}"
        assert protected == self._protected, f"pinned {protected} != counter {self._protected}"


def _common_len(key: list[int], tokens: list[int], start: int) -> int:
    n = min(len(key), len(tokens) - start)
    i = 0
    while i < n and key[i] == tokens[start + i]:
        i += 1
    return i
