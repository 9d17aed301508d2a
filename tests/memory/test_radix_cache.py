"""RadixCache: match / insert / split, locking, LRU eviction, stats, and a property test that
drives it the way the scheduler does and checks KV ownership after every operation."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    precondition,
    rule,
)

from tripod.memory.kv_pool import SlotAllocator
from tripod.memory.prefix_cache import TreeNode
from tripod.memory.radix_cache import RadixCache


def _cache(num_slots: int = 64) -> tuple[SlotAllocator, RadixCache]:
    a = SlotAllocator(num_slots)
    return a, RadixCache(a)


def _put(a: SlotAllocator, c: RadixCache, tokens: list[int]) -> list[int]:
    """Insert ``tokens`` with fresh slots, freeing the duplicates like the scheduler does."""
    slots = a.alloc(len(tokens))
    assert slots is not None
    present, _ = c.insert(tokens, slots)
    a.free(slots[:present])
    return slots


def _edges(node: TreeNode) -> list[list[int]]:
    return sorted(child.key for child in node.children.values())


# ---------------------------------------------------------------- match / insert / split


def test_the_shared_core_is_torch_free() -> None:
    """The router's prefix tree stands on the same core (``tripod.memory.radix``) and may not pull torch."""
    code = "import sys, tripod.memory.radix, tripod.router.prefix_tree; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"



def test_empty_cache_matches_nothing() -> None:
    _, c = _cache()
    m = c.match_prefix([1, 2, 3])
    assert m.slots == [] and m.node is c.root
    assert c.match_prefix([]).node is c.root


def test_insert_returns_tokens_already_present() -> None:
    a, c = _cache()
    s1 = a.alloc(4)
    assert s1 is not None
    present, node = c.insert([1, 2, 3, 4], s1)
    assert present == 0 and node.key == [1, 2, 3, 4]
    assert c.total_size == 4

    # Same first three tokens, then different ones: three already present.
    s2 = a.alloc(5)
    assert s2 is not None
    present, node = c.insert([1, 2, 3, 9, 9], s2)
    assert present == 3
    assert node.key == [9, 9] and node.value == s2[3:]
    assert c.total_size == 6, "only the two new tokens are stored"

    # A prefix of something stored: everything present, nothing taken.
    s3 = a.alloc(2)
    assert s3 is not None
    present, node = c.insert([1, 2], s3)
    assert present == 2 and node.key == [1, 2] and node.value == s1[:2]
    assert c.total_size == 6
    c.check_tree()


def test_match_returns_the_stored_slots() -> None:
    a, c = _cache()
    s1 = _put(a, c, [5, 6, 7, 8])
    s2 = _put(a, c, [5, 6, 1])
    assert c.match_prefix([5, 6, 7, 8, 0]).slots == s1
    assert c.match_prefix([5, 6, 1]).slots == s1[:2] + s2[2:]
    assert c.match_prefix([5, 6, 7]).slots == s1[:3]
    assert c.match_prefix([6, 5]).slots == []


def test_partial_edge_match_splits_so_the_result_ends_on_a_node() -> None:
    a, c = _cache()
    s = _put(a, c, [1, 2, 3, 4, 5])
    assert _edges(c.root) == [[1, 2, 3, 4, 5]]
    m = c.match_prefix([1, 2, 3, 7])
    assert m.slots == s[:3]
    assert m.node.key == [1, 2, 3] and m.node.value == s[:3]
    assert m.node.parent is c.root
    assert _edges(m.node) == [[4, 5]]
    assert next(iter(m.node.children.values())).value == s[3:]
    # Sizes are unchanged by a split: the same slots, now on two nodes.
    assert c.total_size == 5
    c.check_tree()
    # Matching the whole of the query that ends mid-edge splits too.
    m = c.match_prefix([1, 2, 3, 4])
    assert m.node.key == [4] and m.slots == s[:4]
    c.check_tree()


def test_insert_ending_mid_edge_splits() -> None:
    a, c = _cache()
    s = _put(a, c, [1, 2, 3, 4])
    dup = a.alloc(2)
    assert dup is not None
    present, node = c.insert([1, 2], dup)
    assert present == 2
    assert node.key == [1, 2] and node.value == s[:2]
    assert _edges(node) == [[3, 4]]
    c.check_tree()


def test_disabled_cache_stores_and_matches_nothing() -> None:
    a = SlotAllocator(8)
    c = RadixCache(a, enabled=False)
    s = a.alloc(3)
    assert s is not None
    assert c.insert([1, 2, 3], s) == (0, c.root)
    assert c.match_prefix([1, 2, 3]).slots == []
    assert c.total_size == 0


# ---------------------------------------------------------------- locks


def test_lock_pins_the_path_and_unlock_releases_it() -> None:
    a, c = _cache()
    _put(a, c, [1, 2, 3, 4])
    _put(a, c, [1, 2, 9])
    assert c.total_size == 5 and c.protected_size == 0 and c.evictable_size == 5

    deep = c.match_prefix([1, 2, 3, 4]).node
    c.lock(deep)
    # [1, 2] (shared parent) and [3, 4] are pinned; [9] is not.
    assert c.protected_size == 4 and c.evictable_size == 1
    c.check_tree()

    other = c.match_prefix([1, 2, 9]).node
    c.lock(other)
    assert c.protected_size == 5 and c.evictable_size == 0
    c.unlock(deep)
    assert c.protected_size == 3, "[1, 2] stays pinned by the other lock"
    c.unlock(other)
    assert c.protected_size == 0 and c.evictable_size == 5
    c.check_tree()


def test_split_of_a_locked_edge_keeps_the_lock_counts() -> None:
    a, c = _cache()
    _put(a, c, [1, 2, 3, 4])
    node = c.match_prefix([1, 2, 3, 4]).node
    c.lock(node)
    c.lock(node)
    upper = c.match_prefix([1, 2, 7]).node  # splits the pinned edge
    assert upper.key == [1, 2] and upper.lock_ref == 2 and node.lock_ref == 2
    assert c.protected_size == 4
    c.check_tree()
    c.unlock(node)
    c.unlock(node)
    assert c.protected_size == 0 and upper.lock_ref == 0
    c.check_tree()


def test_lock_root_is_a_no_op() -> None:
    _, c = _cache()
    c.lock(c.root)
    c.unlock(c.root)
    assert c.protected_size == 0 and c.root.lock_ref == 1


# ---------------------------------------------------------------- eviction


def test_evict_frees_unpinned_leaves_only() -> None:
    a, c = _cache(16)
    _put(a, c, [1, 2, 3])
    _put(a, c, [1, 2, 4])
    _put(a, c, [5, 6])
    assert a.num_free == 16 - 6
    pinned = c.match_prefix([1, 2, 3]).node
    c.lock(pinned)
    freed = c.evict(100)
    # [5, 6] and [4] go; [1, 2] + [3] are pinned.
    assert freed == 3
    assert c.total_size == 3 and c.protected_size == 3 and c.evictable_size == 0
    assert a.num_free == 16 - 3
    assert c.match_prefix([1, 2, 3]).slots != []
    assert c.match_prefix([5, 6]).slots == []
    assert c.evict(10) == 0, "nothing evictable remains"
    c.unlock(pinned)
    assert c.evict(1) == 1, "one leaf ([3]) is enough"
    assert c.evict(2) == 2, "then its parent, now a leaf"
    assert c.total_size == 0 and a.num_free == 16
    c.check_tree()


def test_parent_becomes_evictable_after_its_children_go() -> None:
    a, c = _cache(16)
    _put(a, c, [1, 2])
    _put(a, c, [1, 2, 3])  # child of [1, 2]
    _put(a, c, [1, 2, 4])
    # Leaves first: 3 tokens requested means [3] and [4] (one token each) and then [1, 2].
    assert c.evict(3) == 4
    assert c.total_size == 0 and a.num_free == 16


def test_evict_is_least_recently_used_first() -> None:
    a, c = _cache(32)
    _put(a, c, [1, 1])
    _put(a, c, [2, 2])
    _put(a, c, [3, 3])
    c.match_prefix([1, 1])  # [1, 1] is now the most recently used
    assert c.evict(2) == 2
    assert c.match_prefix([2, 2], record=False).slots == [], "oldest goes first"
    assert len(c.match_prefix([3, 3], record=False).slots) == 2
    assert len(c.match_prefix([1, 1], record=False).slots) == 2
    c.match_prefix([1, 1], record=False)  # touch again: now [3, 3] is the oldest
    assert c.evict(1) == 2
    assert c.match_prefix([3, 3], record=False).slots == []
    assert len(c.match_prefix([1, 1], record=False).slots) == 2


def test_evict_stops_once_enough_is_freed() -> None:
    a, c = _cache(32)
    for t in range(5):
        _put(a, c, [t, t, t])
    assert c.evict(4) == 6, "whole leaves: two 3-token leaves cover 4 tokens"
    assert c.total_size == 9
    assert c.stats.evicted_tokens == 6
    assert c.evict(0) == 0 and c.total_size == 9


def test_reset_drops_everything_unpinned() -> None:
    a, c = _cache(32)
    _put(a, c, [1, 2, 3])
    _put(a, c, [4, 5])
    node = c.match_prefix([4, 5]).node
    c.lock(node)
    c.reset()
    assert c.total_size == 2 and c.protected_size == 2
    c.unlock(node)
    c.reset()
    assert c.total_size == 0 and a.num_free == 32


# ---------------------------------------------------------------- stats


def test_hit_statistics() -> None:
    a, c = _cache()
    _put(a, c, [1, 2, 3, 4])
    c.match_prefix([1, 2, 3, 4, 5, 6])  # 4 of 6 hit
    c.match_prefix([7, 8])  # 0 of 2
    c.match_prefix([1, 2], record=False)  # not counted
    assert c.stats.queries == 2
    assert c.stats.query_tokens == 8
    assert c.stats.hit_tokens == 4
    assert c.stats.hit_rate == 0.5


def test_hit_rate_without_queries_is_zero() -> None:
    _, c = _cache()
    assert c.stats.hit_rate == 0.0


# ---------------------------------------------------------------- property test


@dataclass
class _SimReq:
    tokens: list[int]
    slots: list[int]  # slots[:cache_len] belong to the tree, the rest are private
    cache_len: int
    node: TreeNode


_TOKENS = st.lists(st.integers(0, 3), min_size=1, max_size=12)


class RadixMachine(RuleBasedStateMachine):
    """Requests that match, pin, allocate their tail, insert on finish (or on a chunk) and
    unlock, interleaved with evictions; the KV ownership invariant is checked throughout."""

    NUM_SLOTS = 64
    reqs = Bundle("reqs")

    def __init__(self) -> None:
        super().__init__()
        self.alloc = SlotAllocator(self.NUM_SLOTS)
        self.cache = RadixCache(self.alloc)
        self.token_of: dict[int, int] = {}  # what each handed-out slot "holds"
        self.live: dict[int, _SimReq] = {}
        self.next_id = 0

    def _check_match(self, tokens: list[int], slots: list[int]) -> None:
        assert len(slots) <= len(tokens)
        assert [self.token_of[s] for s in slots] == tokens[: len(slots)]

    @rule(target=reqs, tokens=_TOKENS)
    def start(self, tokens: list[int]) -> int:
        m = self.cache.match_prefix(tokens)
        self._check_match(tokens, m.slots)
        self.cache.lock(m.node)
        need = len(tokens) - len(m.slots)
        if self.alloc.num_free < need:
            self.cache.evict(need - self.alloc.num_free)
        free_before = self.alloc.free_set()
        new = self.alloc.alloc(need)
        if new is None:
            assert self.alloc.free_set() == free_before, "a failed alloc took slots"
            self.cache.unlock(m.node)
            return -1
        for s, t in zip(new, tokens[len(m.slots) :], strict=True):
            self.token_of[s] = t
        rid = self.next_id
        self.next_id += 1
        self.live[rid] = _SimReq(list(tokens), m.slots + new, len(m.slots), m.node)
        return rid

    def _cache_prefix(self, r: _SimReq, k: int) -> None:
        """``Scheduler.cache_prefix`` for the first ``k`` tokens."""
        present, _ = self.cache.insert(r.tokens[:k], r.slots[:k])
        assert present >= r.cache_len, "the pinned prefix must still be in the tree"
        m = self.cache.match_prefix(r.tokens[:k], record=False)
        assert len(m.slots) == k
        self._check_match(r.tokens, m.slots)
        # The tree took our slots for the tokens it did not have.
        assert m.slots[present:] == r.slots[present:k]
        self.alloc.free(r.slots[r.cache_len : present])
        self.cache.lock(m.node)
        self.cache.unlock(r.node)
        r.slots[:k] = m.slots
        r.cache_len = k
        r.node = m.node

    @rule(rid=reqs, frac=st.floats(0, 1))
    def chunk(self, rid: int, frac: float) -> None:
        r = self.live.get(rid)
        if r is None:
            return
        k = r.cache_len + round(frac * (len(r.tokens) - r.cache_len))
        self._cache_prefix(r, k)

    @rule(rid=consumes(reqs))
    def finish(self, rid: int) -> None:
        r = self.live.pop(rid, None)
        if r is None:
            return
        self._cache_prefix(r, len(r.tokens))
        self.cache.unlock(r.node)
        assert r.slots[r.cache_len :] == []

    @rule(rid=consumes(reqs))
    def abort(self, rid: int) -> None:
        r = self.live.pop(rid, None)
        if r is None:
            return
        self.cache.unlock(r.node)
        self.alloc.free(r.slots[r.cache_len :])

    @rule(n=st.integers(0, 70))
    def evict(self, n: int) -> None:
        evictable = self.cache.evictable_size
        freed = self.cache.evict(n)
        assert freed <= evictable
        assert freed >= min(n, evictable) or self.cache.evictable_size == 0
        assert self.cache.evictable_size == evictable - freed

    @precondition(lambda self: self.cache.total_size > 0)
    @rule(tokens=_TOKENS)
    def lookup(self, tokens: list[int]) -> None:
        m = self.cache.match_prefix(tokens)
        self._check_match(tokens, m.slots)
        # The match is the longest: no child of its node continues the query.
        if len(m.slots) < len(tokens):
            assert tokens[len(m.slots)] not in m.node.children

    @invariant()
    def tree_is_sound(self) -> None:
        self.cache.check_tree()

    @invariant()
    def every_slot_has_exactly_one_owner(self) -> None:
        owner: dict[int, str] = {}
        for s in self.alloc.free_set():
            owner[s] = "free"
        for s in self.cache.slots_in_tree():
            assert s not in owner, f"slot {s} is {owner[s]} and in the tree"
            owner[s] = "tree"
        for rid, r in self.live.items():
            for s in r.slots[r.cache_len :]:
                assert s not in owner, f"slot {s} of req {rid} is also {owner[s]}"
                owner[s] = f"req {rid}"
        assert len(owner) == self.NUM_SLOTS, "a slot is owned by nobody (leak)"

    @invariant()
    def pinned_prefixes_are_in_the_tree(self) -> None:
        tree = set(self.cache.slots_in_tree())
        pinned: set[int] = set()
        for r in self.live.values():
            assert set(r.slots[: r.cache_len]) <= tree
            pinned.update(r.slots[: r.cache_len])
        assert self.cache.protected_size == len(pinned)
        if not self.live:
            assert self.cache.protected_size == 0

    @invariant()
    def tree_edges_hold_their_tokens(self) -> None:
        stack = [self.cache.root]
        while stack:
            n = stack.pop()
            assert [self.token_of[s] for s in n.value] == n.key
            stack.extend(n.children.values())


RadixMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
TestRadixMachine = RadixMachine.TestCase
