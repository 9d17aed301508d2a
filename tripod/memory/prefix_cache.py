"""The prefix cache's interface: what the scheduler (and prompt scoring, the KV export) may ask of it.

Two caches implement it: ``RadixCache`` (``radix_cache.py``: the pool only) and ``TieredCache``
(``tiered_cache.py``: the radix cache with the disk tier under it, ``--kv-disk``). The scheduler
holds one ``PrefixCache`` and never asks which: a pool-only cache has nothing to prefetch or load.

Keys are token ids; a LoRA adapter's requests are keyed in a namespace of their own
(``namespaced_key``), so a base prefix is never reused for an adapter's request, nor one adapter's
for another's. The disk tier keeps only the base namespace (its identity has no adapter in it).
An image's placeholder tokens are keyed by the image's content (``image_key``: a negative 62-bit
hash of the image digest and the token's place in the image), so two requests with the same image
share its KV and different images — same placeholder ids, other pixels — never do; the disk tier
and the KV transfer store these keys as they are (int64 block tokens).

Locking rules (every implementation keeps them):

- ``lock(node)`` pins ``node`` and every ancestor (a count per node); ``unlock`` releases one pin.
  A running request holds one lock on the deepest node of its cached prefix. Pinned nodes are
  never evicted, by ``evict`` or by a tier's ``load`` making room.
- ``insert`` takes ownership of the slots it stores, except where a prefix of the tokens is
  already in the tree: those duplicate slots stay the caller's (``insert`` says how many leading
  tokens were present), and the caller frees its copies.
- ``evict(n)`` frees the slots of least-recently-used unpinned leaves until ``n`` slots are freed
  or nothing evictable remains (a tier first copies their rows out).
- ``load`` (at admission) extends the pool's match of a prompt with what a lower tier holds, into
  unpinned tree nodes the admission's match then finds; ``prefetch`` (at enqueue) starts reading
  them in the background. Both are no-ops for a pool-only cache.

Every slot is in exactly one of: the allocator's free list, a running request's private tail, or
the tree (``slots_in_tree``); ``Scheduler.assert_consistent`` checks it with ``check_tree``.
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass
from typing import Protocol

from tripod.memory.kv_pool import SlotAllocator
from tripod.memory.radix import RadixNode

# A node of a prefix cache's tree: ``key`` the token ids on its edge, ``value`` their KV slots,
# ``lock_ref`` the pins of the requests running on it (see ``tripod.memory.radix``).
TreeNode = RadixNode[list[int]]

# A namespace's token ids are shifted by this (above any vocabulary) in the cache's keys.
NAMESPACE_STRIDE = 1 << 21
MAX_NAMESPACES = (1 << 31) // NAMESPACE_STRIDE - 1  # (text keys stay below 2^31)
IMAGE_KEY_BITS = 62  # an image token's key: -1 - (62 bits of hash), below every text key


def namespaced_key(ids: list[int], namespace: int) -> list[int]:
    """The cache key of ``ids`` in ``namespace`` (0: the base model's, unchanged)."""
    if namespace == 0:
        return ids
    shift = namespace * NAMESPACE_STRIDE
    return [t + shift for t in ids]


def image_key(digest: str, length: int) -> list[int]:
    """The cache keys of an image's ``length`` placeholder tokens: each token's from the image's
    content digest and its place in the image (independent 62-bit hashes, negative so that no text
    token id or LoRA namespace can equal one). NOTE: 62 bits, not 31: a key shared by two images'
    tokens at one place after one prefix would hand one image's KV to the other, and with many
    images after one system prompt a 31-bit key collides within millions of requests."""
    raw = hashlib.shake_128(b"tripod-image\0" + digest.encode()).digest(8 * length)
    mask = (1 << IMAGE_KEY_BITS) - 1
    return [-1 - (v & mask) for v in array("Q", raw)]


def keyed_with_images(ids: list[int], spans: list[tuple[str, int, int]]) -> list[int]:
    """``ids`` with each image span (digest, offset, length) replaced by its ``image_key``."""
    out = list(ids)
    for digest, offset, length in spans:
        out[offset : offset + length] = image_key(digest, length)
    return out


def in_base_namespace(key: list[int]) -> bool:
    """Whether a cache key is the base model's (an adapter's keys start at ``NAMESPACE_STRIDE``)."""
    return not key or key[0] < NAMESPACE_STRIDE


@dataclass(slots=True)
class MatchResult:
    slots: list[int]  # KV slots of the matched prefix
    node: TreeNode  # deepest node covering exactly the matched prefix (root if none)
    rank: int = 0  # the data-parallel rank whose tree (and pool) holds them


@dataclass(slots=True)
class CacheStats:
    queries: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    evicted_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


class PrefixCache(Protocol):
    """A token-granular prefix cache over one KV pool's slots (see the module docstring for the
    locking and ownership rules every implementation keeps)."""

    allocator: SlotAllocator
    enabled: bool
    stats: CacheStats

    @property
    def total_size(self) -> int:
        """Slots the trees hold (pinned or not)."""
        ...

    @property
    def evictable_size(self) -> int:
        """Slots held by unpinned nodes."""
        ...

    @property
    def protected_size(self) -> int:
        """Slots held by pinned nodes."""
        ...

    def match_prefix(self, tokens: list[int], *, record: bool = True, rank: int | None = None) -> MatchResult:
        """The longest cached prefix of ``tokens`` (in ``rank``'s tree; None: the longest over
        every rank), ending on a node (an edge is split where the match ends). ``record``: count it
        in ``stats``."""
        ...

    def record(self, query_tokens: int, hit_tokens: int) -> None:
        """Count one lookup made with ``record=False`` (a choice among ranks' trees)."""
        ...

    def lock(self, node: TreeNode) -> None: ...

    def unlock(self, node: TreeNode) -> None: ...

    def insert(self, tokens: list[int], slots: list[int]) -> tuple[int, TreeNode]:
        """Store ``tokens`` → ``slots``; (tokens already present, the node ending the path)."""
        ...

    def evict(self, num_tokens: int, rank: int | None = None) -> int:
        """Free at least ``num_tokens`` slots of unpinned LRU leaves if possible; how many were."""
        ...

    def prefetch(self, tokens: list[int]) -> None:
        """A request was queued: start reading what a lower tier holds beyond the pool's match."""
        ...

    def load(self, tokens: list[int], *, headroom: int, chunk: int, record: bool) -> int:
        """A request is being admitted: bring a lower tier's blocks that extend the pool's match
        of ``tokens`` into the pool (leaving ``headroom`` slots and room for a first chunk of at
        most ``chunk`` tokens); how many tokens came in. ``record``: count them as hits."""
        ...

    def reset(self) -> None:
        """Drop every unpinned entry."""
        ...

    def close(self) -> None:
        """The engine stops: keep what should survive a restart (a tier saves the tree)."""
        ...

    def slots_in_tree(self) -> list[int]: ...

    def check_tree(self) -> None:
        """Assert the trees' structural invariants (sizes, pins, keys, ranks)."""
        ...
