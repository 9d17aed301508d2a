"""An approximate radix tree of the prompts one replica has seen, over characters.

The router cannot see a replica's KV cache; it remembers what it sent there. A request's rendered
prompt (the whole conversation) is matched against each replica's tree: the longest common prefix
is what that replica probably still has cached. "Approximate" because the replica evicts on its own
schedule; the tree keeps a character budget and evicts least-recently-used leaves past it.

Characters, not tokens: the router holds no tokenizer (it only speaks HTTP); chat templates are
concatenative per message, so a character prefix of the rendered conversation is a token prefix
of the replica's prompt up to the last few tokens at the boundary.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field


@dataclass(slots=True, eq=False)
class _Node:
    edge: str  # the characters on the edge from the parent to this node
    parent: _Node | None
    children: dict[str, _Node] = field(default_factory=dict)  # first character of edge → child
    last_access: float = 0.0


class PrefixTree:
    """Owns the prompts sent to one replica. Invariant: ``size`` is the sum of all edge lengths
    and, after every ``insert``, is at most ``max_chars`` (least-recently-used leaves go first)."""

    def __init__(self, max_chars: int = 2_000_000) -> None:
        if max_chars < 1:
            raise ValueError(f"max_chars must be >= 1 (got {max_chars})")
        self.max_chars = max_chars
        self.root = _Node("", None)
        self.size = 0

    def match(self, text: str) -> int:
        """How many leading characters of ``text`` the tree holds."""
        node, i = self.root, 0
        while i < len(text):
            child = node.children.get(text[i])
            if child is None:
                return i
            common = _common_prefix(child.edge, text, i)
            i += common
            if common < len(child.edge):
                return i
            node = child
        return i

    def insert(self, text: str, now: float) -> None:
        """Remember ``text`` (marking its whole path used at ``now``), then evict to the budget."""
        node, i = self.root, 0
        node.last_access = now
        while i < len(text):
            child = node.children.get(text[i])
            if child is None:
                leaf = _Node(text[i:], node, last_access=now)
                node.children[text[i]] = leaf
                self.size += len(leaf.edge)
                break
            common = _common_prefix(child.edge, text, i)
            if common < len(child.edge):
                child = self._split(child, common)
            child.last_access = now
            i += common
            node = child
        if self.size > self.max_chars:
            self._evict(self.max_chars)

    def clear(self) -> None:
        self.root = _Node("", None)
        self.size = 0

    def _split(self, child: _Node, at: int) -> _Node:
        """Cut ``child``'s edge after ``at`` characters; returns the new middle node."""
        parent = child.parent
        assert parent is not None and 0 < at < len(child.edge)
        mid = _Node(child.edge[:at], parent, last_access=child.last_access)
        parent.children[mid.edge[0]] = mid
        child.edge = child.edge[at:]
        child.parent = mid
        mid.children[child.edge[0]] = child
        return mid

    def _evict(self, target: int) -> None:
        # NOTE: a parent's last_access is always >= its children's (insert touches the whole
        # path), so popping leaves oldest-first and pushing parents that become leaves evicts in
        # LRU order without ever stranding an older interior node.
        heap = [(n.last_access, id(n), n) for n in self._leaves()]
        heapq.heapify(heap)
        while self.size > target and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            if parent is None:
                continue
            del parent.children[leaf.edge[0]]
            self.size -= len(leaf.edge)
            if parent is not self.root and not parent.children:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))

    def _leaves(self) -> list[_Node]:
        out, stack = [], [self.root]
        while stack:
            n = stack.pop()
            if n.children:
                stack.extend(n.children.values())
            elif n is not self.root:
                out.append(n)
        return out


def _common_prefix(edge: str, text: str, start: int) -> int:
    """Length of the common prefix of ``edge`` and ``text[start:]``."""
    n = min(len(edge), len(text) - start)
    if edge[:n] == text[start : start + n]:  # the common case (a whole edge matches) in C
        return n
    lo, hi = 0, n  # binary search on slices: O(log n) string compares, each in C
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if edge[:mid] == text[start : start + mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
