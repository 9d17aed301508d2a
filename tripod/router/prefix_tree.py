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

from tripod.memory.radix import RadixNode, RadixTree


class PrefixTree:
    """Owns the prompts sent to one replica (a ``tripod.memory.radix.RadixTree`` over characters).
    Invariant: ``size`` is the sum of all edge lengths and, after every ``insert``, is at most
    ``max_chars`` (least-recently-used leaves go first)."""

    def __init__(self, max_chars: int = 2_000_000) -> None:
        if max_chars < 1:
            raise ValueError(f"max_chars must be >= 1 (got {max_chars})")
        self.max_chars = max_chars
        self._tree: RadixTree[str] = RadixTree("")

    @property
    def size(self) -> int:
        return self._tree.size

    def match(self, text: str) -> int:
        """How many leading characters of ``text`` the tree holds."""
        return self._tree.match(text)[0]

    def insert(self, text: str, now: float) -> list[str]:
        """Remember ``text`` (marking its whole path used at ``now``), then evict to the budget;
        returns the prompts evicted (each the text from the root to an evicted node)."""
        self._tree.insert(text, now)
        if self._tree.size <= self.max_chars:
            return []
        return [_text(node) for node in self._tree.evict(self._tree.size - self.max_chars)]

    def texts(self) -> list[str]:
        """Every prompt held (the text from the root to each leaf)."""
        return [_text(node) for node in self._tree.leaves() if node is not self._tree.root]

    def clear(self) -> None:
        self._tree.clear()


def _text(node: RadixNode[str]) -> str:
    """The characters from the root to ``node`` (which may just have been detached)."""
    parts: list[str] = []
    n: RadixNode[str] | None = node
    while n is not None and n.parent is not None:
        parts.append(n.key)
        n = n.parent
    return "".join(reversed(parts))
