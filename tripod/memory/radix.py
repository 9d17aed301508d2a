"""A radix tree over sequences (token ids or characters) with least-recently-used eviction.

The one core under two trees: the engine's prefix cache (``memory/radix_cache.py``: token ids,
each edge carrying the KV slots of its tokens, nodes pinned while a request uses them) and the
router's approximate tree of what a replica has cached (``router/prefix_tree.py``: characters,
nothing carried, nothing pinned). Torch-free and below both (the router may not import the
engine, nor anything that pulls torch).

An edge holds a run of the key; a path from the root spells a stored prefix. A node's ``value``
is the owner's payload, one entry per element of its edge (or empty where the owner stores
none); it is cut with the edge. A pinned node (``lock_ref`` > 0) is never evicted.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

Key = TypeVar("Key", str, list[int])


@dataclass(slots=True, eq=False)
class RadixNode(Generic[Key]):
    key: Key  # the run of elements on the edge from the parent to this node
    value: list[int] = field(default_factory=list)  # payload per element of ``key`` (or none)
    parent: RadixNode[Key] | None = None
    children: dict[Any, RadixNode[Key]] = field(default_factory=dict)  # first element of key → child
    lock_ref: int = 0  # pins on this node (a pin on a node counts on every ancestor too)
    last_access: float = 0  # larger is more recent

    def __repr__(self) -> str:
        return f"RadixNode(len={len(self.key)}, lock={self.lock_ref}, kids={len(self.children)})"

    def path_value(self) -> list[int]:
        """The payload of the whole path from the root to this node, in order."""
        parts: list[list[int]] = []
        node: RadixNode[Key] | None = self
        while node is not None:
            parts.append(node.value)
            node = node.parent
        out: list[int] = []
        for part in reversed(parts):
            out.extend(part)
        return out


class RadixTree(Generic[Key]):
    """Owns the nodes. Invariants: every child is filed under the first element of its (non-empty)
    edge; ``size`` is the sum of all edge lengths; every use marks the whole path from the root,
    so a parent's ``last_access`` is never older than its children's."""

    def __init__(self, empty: Key) -> None:
        self._empty = empty
        self.root: RadixNode[Key] = RadixNode(empty)
        self.size = 0

    def clear(self) -> None:
        self.root = RadixNode(self._empty)
        self.size = 0

    def match(self, seq: Key, now: float | None = None) -> tuple[int, RadixNode[Key]]:
        """How many leading elements of ``seq`` the tree holds, and the deepest node on that path.

        Without ``now`` a read: the node may end short of the match (mid-edge). With ``now`` a use:
        the path is marked used at ``now``, and an edge matched part-way is split so that the node
        ends exactly where the match does."""
        node, i = self.root, 0
        if now is not None:
            node.last_access = now
        while i < len(seq):
            child = node.children.get(seq[i])
            if child is None:
                break
            common = common_prefix(child.key, seq, i)
            if common < len(child.key):
                if now is None:
                    return i + common, node
                child = self.split(child, common)
            if now is not None:
                child.last_access = now
            i += common
            node = child
        return i, node

    def insert(self, seq: Key, now: float, value: list[int] | None = None) -> tuple[int, RadixNode[Key]]:
        """Store ``seq`` (with ``value``, its payload, one entry per element), marking its path used
        at ``now``. Returns how many leading elements were stored already (the tree keeps its own
        payload for those: ``value``'s entries for them are not taken) and the node ending the path."""
        node, i = self.root, 0
        node.last_access = now
        while i < len(seq):
            child = node.children.get(seq[i])
            if child is None:
                leaf = RadixNode(seq[i:], value[i:] if value is not None else [], node, last_access=now)
                node.children[seq[i]] = leaf
                self.size += len(leaf.key)
                return i, leaf
            common = common_prefix(child.key, seq, i)
            if common < len(child.key):
                child = self.split(child, common)
            child.last_access = now
            i += common
            node = child
        return i, node

    def split(self, child: RadixNode[Key], at: int) -> RadixNode[Key]:
        """Cut ``child``'s edge after ``at`` elements; returns the new upper node."""
        parent = child.parent
        assert parent is not None and 0 < at < len(child.key)
        # NOTE: pins count per path, so the upper half inherits the child's pin count; the size
        # does not change (the same elements, now on two edges).
        upper = RadixNode(child.key[:at], child.value[:at], parent, lock_ref=child.lock_ref,
                          last_access=child.last_access)
        parent.children[upper.key[0]] = upper
        child.key = child.key[at:]
        child.value = child.value[at:]
        child.parent = upper
        upper.children[child.key[0]] = child
        return upper

    def evict(self, n: int) -> list[RadixNode[Key]]:
        """Remove least-recently-used unpinned leaves until at least ``n`` elements are gone or
        nothing evictable is left; a parent whose last child goes becomes a candidate. Returns the
        removed nodes, in order (their payload is the caller's to release)."""
        if n <= 0:
            return []
        # NOTE: a parent is never older than its children (see the class), so popping leaves
        # oldest-first and pushing parents that become leaves evicts in LRU order without ever
        # stranding an older interior node.
        heap = [(node.last_access, id(node), node) for node in self.leaves() if node.lock_ref == 0]
        heapq.heapify(heap)
        removed: list[RadixNode[Key]] = []
        gone = 0
        while gone < n and heap:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            assert parent is not None and node.lock_ref == 0 and not node.children
            del parent.children[node.key[0]]
            self.size -= len(node.key)
            gone += len(node.key)
            removed.append(node)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return removed

    def leaves(self) -> list[RadixNode[Key]]:
        return [node for node in self.nodes() if not node.children and node is not self.root]

    def nodes(self) -> list[RadixNode[Key]]:
        """Every node, the root first (for checks and whole-tree reads)."""
        out: list[RadixNode[Key]] = []
        stack = [self.root]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out


def common_prefix(edge: Key, seq: Key, start: int) -> int:
    """Length of the common prefix of ``edge`` and ``seq[start:]``."""
    n = min(len(edge), len(seq) - start)
    if edge[:n] == seq[start : start + n]:  # the common case (a whole edge matches) in C
        return n
    lo, hi = 0, n  # binary search on slices: O(log n) compares, each in C
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if edge[:mid] == seq[start : start + mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
