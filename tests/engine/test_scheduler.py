"""Scheduler without a model: the test drives the engine's step loop itself (see
``Engine.step``) with fake tokens and checks batching, memory pressure and admission policy."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tripod.engine.request import FinishReason, Req, SamplingParams
from tripod.engine.scheduler import ScheduledItem, SchedulePolicy, Scheduler
from tripod.memory.kv_pool import SlotAllocator
from tripod.memory.radix_cache import RadixCache

_arrival = itertools.count(1)
HOT = list(range(1, 33))  # a 32-token prefix that tests put into the cache first


def make_req(
    prompt: list[int], max_tokens: int = 4, priority: int = 0, rid: str = "", max_len: int = 0
) -> Req:
    # Explicit, strictly increasing arrival times: ties in time.monotonic() must not decide order.
    return Req(
        prompt_ids=list(prompt),
        params=SamplingParams(max_tokens=max_tokens, temperature=0.0, priority=priority),
        rid=rid,
        arrival=float(next(_arrival)),
        max_len=max_len,
    )


class Sim:
    """Scheduler + allocator + cache, stepped like ``Engine.step`` with a fake model."""

    def __init__(
        self,
        num_slots: int = 4096,
        *,
        max_running: int = 16,
        max_batch_tokens: int = 256,
        chunk_size: int = 64,
        policy: str = "lpm",
        aging: float = 8.0,
        cache: bool = True,
        ranks: int = 1,
    ) -> None:
        self.allocator = SlotAllocator(num_slots, ranks)
        self.cache = RadixCache(self.allocator, enabled=cache)
        self.sched = Scheduler(
            self.allocator,
            self.cache,
            max_running=max_running,
            max_batch_tokens=max_batch_tokens,
            chunk_size=chunk_size,
            policy=SchedulePolicy(policy, aging),
        )
        self.admitted: list[str] = []  # rids in order of first admission
        self.sampled: set[str] = set()  # rids that sampled a token in the last step
        self.steps = 0

    def add(self, *reqs: Req) -> None:
        for r in reqs:
            self.sched.add(r)

    def step(self) -> list[ScheduledItem]:
        items = self.sched.schedule()
        self.steps += 1
        for it in items:
            if it.req.rid not in self.admitted:
                self.admitted.append(it.req.rid)
        # Mirror the model runner: a request appears at most once per batch, and each item
        # starts where the request's computed KV ends, with slots for every token.
        assert len({id(it.req) for it in items}) == len(items)
        for it in items:
            req = it.req
            assert it.start == req.computed and it.length >= 1
            assert len(req.slots) == req.computed + it.length
        # NOTE: ScheduledItem.samples reads the request's live state: decide before updating.
        self.sampled = {it.req.rid for it in items if it.samples}
        for it in items:
            req = it.req
            req.computed += it.length
            if req.rid not in self.sampled:
                self.sched.cache_prefix(req)
                continue
            if not req.output_ids and req.retractions == 0:
                self.sched.cache_prefix(req)
            req.output_ids.append(1000 + len(req.output_ids))  # a fake token
            if len(req.output_ids) >= req.params.max_tokens:
                self.sched.finish(req, FinishReason.LENGTH)
        self.sched.assert_consistent()
        return items

    def run(self, reqs: list[Req], max_steps: int = 10_000) -> None:
        while any(not r.finished for r in reqs):
            assert self.steps < max_steps, "the scheduler stopped making progress"
            self.step()

    def assert_no_leak(self) -> None:
        assert not self.sched.running and not self.sched.waiting
        assert self.cache.protected_size == 0
        assert self.allocator.num_free + self.cache.evictable_size == self.allocator.num_slots


def _item(items: list[ScheduledItem], req: Req) -> ScheduledItem | None:
    found = [it for it in items if it.req is req]
    return found[0] if found else None


# ---------------------------------------------------------------- chunked prefill


def test_chunked_prefill_never_stalls_a_decode() -> None:
    sim = Sim(chunk_size=16, max_batch_tokens=64)
    a = make_req(list(range(8)), max_tokens=30, rid="a")
    sim.add(a)
    sim.step()  # a's whole prompt; it is decoding from now on
    assert a.output_ids and a.computed == 8

    b = make_req(list(range(100, 200)), max_tokens=2, rid="b")  # 100 tokens
    sim.add(b)
    chunks: list[int] = []
    while not b.output_ids:
        before = len(a.output_ids)
        items = sim.step()
        ia, ib = _item(items, a), _item(items, b)
        assert ia is not None and ia.length == 1 and "a" in sim.sampled, "a decodes every step"
        assert len(a.output_ids) == before + 1
        assert ib is not None
        chunks.append(ib.length)
        # A chunk is shared through the cache as soon as it is computed.
        if not b.output_ids:
            assert b.cache_len == b.computed
    assert chunks == [16, 16, 16, 16, 16, 16, 4]
    sim.run([a, b])
    assert len(a.output_ids) == 30 and len(b.output_ids) == 2
    sim.assert_no_leak()


def test_batch_token_budget_bounds_each_step() -> None:
    sim = Sim(chunk_size=64, max_batch_tokens=40)
    reqs = [make_req([i] * 50 + [i + 1], max_tokens=3) for i in range(0, 40, 2)]
    sim.add(*reqs)
    while any(not r.finished for r in reqs):
        items = sim.step()
        assert sum(it.length for it in items) <= 40
        assert all(it.length <= 64 for it in items)
    sim.assert_no_leak()


# ---------------------------------------------------------------- memory pressure


def test_tiny_kv_budget_evicts_waits_and_retracts_yet_everything_finishes() -> None:
    total = 48
    sim = Sim(total, max_running=8, max_batch_tokens=64, chunk_size=8)
    reqs = []
    for i in range(12):
        shared = [7, 7, 7, 7] if i % 3 == 0 else []  # some prefix sharing, so the cache fills
        prompt = shared + [i % 5, i, i + 1, i + 2, 50 + i][: 3 + i % 3] + [i] * (i % 4)
        reqs.append(make_req(prompt, max_tokens=6 + i % 7, rid=f"r{i}", max_len=total))
    sim.add(*reqs)

    saw_waiting_while_running = False
    while any(not r.finished for r in reqs):
        assert sim.steps < 2000, "no progress under memory pressure"
        if sim.sched.waiting and sim.sched.running:
            saw_waiting_while_running = True
        sim.step()

    for r in reqs:
        assert r.finish_reason is FinishReason.LENGTH
        assert len(r.output_ids) == r.params.max_tokens, r
        assert r.output_ids == [1000 + k for k in range(r.params.max_tokens)]
    # The budget was really too small: all three pressure valves opened.
    assert saw_waiting_while_running
    assert sim.sched.num_retractions > 0
    assert any(r.retractions > 0 for r in reqs)
    assert sim.cache.stats.evicted_tokens > 0
    sim.assert_no_leak()


def test_retracted_request_resumes_from_its_outputs() -> None:
    total = 24
    sim = Sim(total, max_running=4, max_batch_tokens=32, chunk_size=32)
    old = make_req([1, 2, 3, 4, 5], max_tokens=12, rid="old", max_len=total)
    young = make_req([9, 8, 7, 6, 5], max_tokens=12, rid="young", max_len=total)
    sim.add(old, young)
    sim.run([old, young])
    # Two requests of up to 17 tokens cannot both fit in 24 slots: the younger one (less
    # important) was retracted at least once, and still produced all its tokens in order.
    assert young.retractions > 0 and old.retractions == 0
    assert young.output_ids == [1000 + k for k in range(12)]
    assert old.output_ids == [1000 + k for k in range(12)]
    sim.assert_no_leak()


def test_admission_leaves_headroom_for_running_decodes() -> None:
    total = 16
    sim = Sim(total, max_running=4, max_batch_tokens=64, chunk_size=64)
    a = make_req([1, 2, 3, 4], max_tokens=8, rid="a", max_len=total)
    sim.add(a)
    sim.step()  # a decodes from now on, pinning its 4 slots
    b = make_req(list(range(20, 31)), max_tokens=5, rid="b", max_len=total)
    sim.add(b)
    sim.step()
    # This step a's decode took one slot, leaving exactly b's 11 prompt tokens free.
    assert len(a.slots) == 5 and sim.allocator.num_free == 11
    # Admitting b would leave a no slot for its next token: b waits instead of being admitted
    # and then retracted (which would throw its computed prefill away).
    assert b in sim.sched.waiting
    sim.run([a, b])
    assert sim.sched.num_retractions == 0
    assert len(a.output_ids) == 8 and len(b.output_ids) == 5
    sim.assert_no_leak()


def test_abort_releases_kv() -> None:
    sim = Sim(64, chunk_size=4)
    a = make_req(list(range(10)), max_tokens=20)
    b = make_req(list(range(20, 30)), max_tokens=20)
    sim.add(a, b)
    sim.step()
    sim.step()
    sim.sched.abort(a)  # running, mid-prefill
    sim.sched.abort(b)
    assert a.finish_reason is FinishReason.ABORT and b.finish_reason is FinishReason.ABORT
    sim.sched.assert_consistent()
    sim.assert_no_leak()
    # What a computed is kept in the cache for the next request with the same prefix.
    assert sim.cache.total_size > 0


# ---------------------------------------------------------------- LPM aging


def _starvation_run(
    aging: float, stream_steps: int, prefix_len: int
) -> tuple[Sim, Req, int | None]:
    """One cache-missing request waits while a stream of cache hits arrives, one per step.

    Returns the simulator, the missing request and the step (counted from its arrival) at
    which it was admitted while the stream was still flowing, or None.
    """
    sim = Sim(max_running=1, max_batch_tokens=256, chunk_size=256, aging=aging)
    prefix = list(range(1, prefix_len + 1))
    warm = make_req([*prefix, 0], max_tokens=1)
    sim.add(warm)
    sim.run([warm])
    assert len(sim.cache.match_prefix(prefix, record=False).slots) == prefix_len

    miss = make_req([500, 501, 502, 503], max_tokens=1, rid="miss")
    sim.add(miss)
    admitted_at = None
    for k in range(1, stream_steps + 1):
        hit = make_req([*prefix, 1000 + k], max_tokens=1, rid=f"hit{k}")
        sim.add(hit)
        items = sim.step()
        assert len(items) == 1, "max_running=1: one request per step"
        if items[0].req is miss:
            admitted_at = k
            break
    return sim, miss, admitted_at


@pytest.mark.parametrize("aging", [4.0, 8.0, 16.0])
def test_lpm_aging_prevents_starvation(aging: float) -> None:
    prefix_len, stream = 64, 60
    _, miss, admitted_at = _starvation_run(aging, stream, prefix_len)
    # A fresh hit scores prefix_len + aging * 1 (it waited one step); the miss scores
    # aging * age and wins ties by arriving first, so it goes once aging * age >= that.
    bound = math.ceil((prefix_len + aging) / aging)
    assert admitted_at is not None, "the cache-missing request was starved"
    assert admitted_at <= bound
    assert admitted_at > 1, "a cache hit is still preferred while the miss is fresh"
    assert miss.cached_tokens == 0


def test_lpm_without_aging_starves_the_miss() -> None:
    stream = 60
    sim, miss, admitted_at = _starvation_run(0.0, stream, 64)
    assert admitted_at is None, "with aging=0 a stream of cache hits always wins"
    assert miss in sim.sched.waiting
    # Once the stream dries up the miss is served.
    sim.run([*sim.sched.waiting])
    assert miss.finished
    sim.assert_no_leak()


def test_lpm_prefers_the_longest_cached_prefix() -> None:
    sim = Sim(max_running=1, policy="lpm")
    warm = make_req([*HOT, 0], max_tokens=1)
    sim.add(warm)
    sim.run([warm])
    cold = make_req([900, 901, 902], max_tokens=1, rid="cold")  # arrives first
    short = make_req([*HOT[:8], 77], max_tokens=1, rid="short")
    long = make_req([*HOT, 78], max_tokens=1, rid="long")
    sim.add(cold, short, long)
    sim.run([cold, short, long])
    assert sim.admitted[-3:] == ["long", "short", "cold"]
    assert long.cached_tokens == 32 and short.cached_tokens == 8 and cold.cached_tokens == 0


# ---------------------------------------------------------------- priority and fcfs


@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
def test_higher_priority_is_admitted_first(policy: str) -> None:
    sim = Sim(max_running=1, policy=policy)
    warm = make_req([*HOT, 0], max_tokens=1)
    sim.add(warm)
    sim.run([warm])
    # The low-priority requests arrive first and (for lpm) have a long cache hit; priority
    # must still dominate both arrival order and prefix length.
    low = make_req([*HOT, 5], max_tokens=2, rid="low", priority=0)
    lower = make_req([*HOT, 6], max_tokens=2, rid="lower", priority=-1)
    high = make_req([700, 701, 702], max_tokens=2, rid="high", priority=5)
    sim.add(lower, low, high)
    sim.run([low, lower, high])
    assert sim.admitted[-3:] == ["high", "low", "lower"]
    sim.assert_no_leak()


def test_fcfs_admits_in_arrival_order_regardless_of_cache_hits() -> None:
    sim = Sim(max_running=1, policy="fcfs")
    warm = make_req([*HOT, 0], max_tokens=1)
    sim.add(warm)
    sim.run([warm])
    reqs = [
        make_req([300 + i, 301 + i], max_tokens=2, rid=f"cold{i}")
        if i % 2 == 0
        else make_req([*HOT, i], max_tokens=2, rid=f"hot{i}")
        for i in range(6)
    ]
    # Add them out of arrival order: fcfs follows arrival, not insertion.
    sim.add(*reversed(reqs))
    sim.run(reqs)
    assert sim.admitted[-6:] == [r.rid for r in reqs]
    sim.assert_no_leak()


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="policy"):
        SchedulePolicy("random")


# ---------------------------------------------------------------- n > 1 siblings


@pytest.mark.parametrize("chunk_size", [64, 8])
def test_siblings_wait_for_the_first_copy_then_share_its_prompt(chunk_size: int) -> None:
    sim = Sim(chunk_size=chunk_size, max_batch_tokens=128)
    prompt = list(range(10, 40))  # 30 tokens
    first = make_req(prompt, max_tokens=5, rid="x-0")
    sibs = [make_req(prompt, max_tokens=5, rid=f"x-{i}") for i in (1, 2, 3)]
    for s in sibs:
        s.wait_for = first
    sim.add(first, *sibs)

    while first.computed < len(prompt):
        items = sim.step()
        assert all(_item(items, s) is None for s in sibs), (
            "a sibling ran before the prompt was cached"
        )
        assert all(s in sim.sched.waiting for s in sibs)
    items = sim.step()
    for s in sibs:
        it = _item(items, s)
        assert it is not None, "siblings are admitted as soon as the prompt is computed"
        assert it.start == len(prompt) - 1 and it.length == 1
        assert s.cached_tokens == len(prompt) - 1
    sim.run([first, *sibs])
    assert all(len(r.output_ids) == 5 for r in [first, *sibs])
    sim.assert_no_leak()


def test_prefix_cache_disabled_still_consistent() -> None:
    sim = Sim(64, chunk_size=8, cache=False)
    reqs = [
        make_req([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, i], max_tokens=8, max_len=64) for i in range(6)
    ]
    sim.add(*reqs)
    sim.run(reqs)
    assert all(r.cached_tokens == 0 for r in reqs)
    assert sim.cache.total_size == 0
    sim.assert_no_leak()


# ---------------------------------------------------------------- data-parallel attention


def test_dp_ranks_each_hold_their_requests_and_a_prefix_goes_where_it_is_cached() -> None:
    """Two ranks' slot ranges: requests without a cache hit spread over the ranks; a request whose
    prompt extends a cached prefix runs on the rank holding it (and its slots stay there)."""
    sim = Sim(128, ranks=2, chunk_size=64)
    a = make_req([*HOT, 40, 41], max_tokens=3, rid="a")
    b = make_req(list(range(50, 70)), max_tokens=3, rid="b")
    sim.add(a, b)
    sim.step()
    assert {a.dp_rank, b.dp_rank} == {0, 1}, "two misses at once went to one rank"
    sim.run([a, b])
    c = make_req([*HOT, 42], max_tokens=2, rid="c")
    sim.add(c)
    sim.step()
    assert c.dp_rank == a.dp_rank and c.cached_tokens == len(HOT)
    assert all(sim.allocator.rank_of(s) == a.dp_rank for s in c.slots)
    sim.run([c])
    sim.assert_no_leak()


def test_dp_rank_full_evicts_its_own_cache_only() -> None:
    """A rank out of slots evicts its own tree's entries; the other rank's cache stays."""
    sim = Sim(64, ranks=2, chunk_size=64, max_running=1)
    done = []
    for rid, first in (("x", 100), ("y", 200), ("z", 300)):
        r = make_req(list(range(first, first + 20)), max_tokens=2, rid=rid)
        sim.add(r)
        sim.run([r])
        done.append(r)
    x, y, z = done
    assert x.dp_rank != y.dp_rank, "y went to the rank with fewer free slots"
    # z (no hit) fits on neither rank without evicting: its rank drops its own entry, the other keeps its
    kept = y if z.dp_rank == x.dp_rank else x
    assert sim.cache.stats.evicted_tokens > 0
    assert sim.cache.match_prefix(kept.prompt_ids, record=False).slots, "the other rank's cache was evicted"
    assert sim.cache.trees[kept.dp_rank].size >= len(kept.prompt_ids)
    sim.assert_no_leak()


# ---------------------------------------------------------------- randomised


_REQ = st.tuples(
    st.lists(st.integers(0, 3), min_size=1, max_size=14),  # prompt: small alphabet, many hits
    st.integers(1, 10),  # max_tokens
    st.sampled_from([1, 1, 2, 3]),  # n
    st.integers(0, 1),  # priority
    st.integers(0, 12),  # arrival step
)


@settings(max_examples=150, deadline=None)
@given(
    total=st.sampled_from([16, 24, 48, 128]),
    max_running=st.sampled_from([1, 2, 4, 8]),
    extra_tokens=st.sampled_from([0, 8, 64]),
    chunk_size=st.sampled_from([1, 3, 8, 64]),
    policy=st.sampled_from(["lpm", "fcfs"]),
    aging=st.sampled_from([0.0, 1.0, 8.0]),
    cache=st.booleans(),
    ranks=st.sampled_from([1, 1, 2]),
    specs=st.lists(_REQ, min_size=1, max_size=10),
    aborts=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 29)), max_size=3),
)
def test_random_workloads_finish_without_leaks(
    total: int,
    max_running: int,
    extra_tokens: int,
    chunk_size: int,
    policy: str,
    aging: float,
    cache: bool,
    ranks: int,
    specs: list[tuple[list[int], int, int, int, int]],
    aborts: list[tuple[int, int]],
) -> None:
    # ranks=2: data-parallel attention's slot ranges, ``total`` slots each (a request's KV on one rank)
    sim = Sim(
        total * ranks,
        ranks=ranks,
        max_running=max_running,
        max_batch_tokens=max_running + extra_tokens,
        chunk_size=chunk_size,
        policy=policy,
        aging=aging,
        cache=cache,
    )
    arrivals: list[tuple[int, Req]] = []
    for i, (prompt, max_tokens, n, priority, at) in enumerate(specs):
        max_tokens = max(1, min(max_tokens, total - len(prompt)))  # the engine caps at max_len
        first: Req | None = None
        for j in range(n):
            r = make_req(prompt, max_tokens, priority, rid=f"r{i}-{j}", max_len=total)
            if first is not None and cache:
                r.wait_for = first
            first = first or r
            arrivals.append((at, r))
    reqs = [r for _, r in arrivals]
    arrive = {r.rid: at for at, r in arrivals}
    aborted: set[str] = set()
    step = 0
    while step <= 12 or sim.sched.has_work:
        assert step < 2000, "no progress"
        for at, r in arrivals:
            if at == step:
                sim.add(r)
        for at, k in aborts:
            if (
                at == step
                and k < len(reqs)
                and arrive[reqs[k].rid] <= step
                and not reqs[k].finished
            ):
                sim.sched.abort(reqs[k])
                aborted.add(reqs[k].rid)
                sim.sched.assert_consistent()
        if sim.sched.has_work:
            sim.step()
        step += 1
    for r in reqs:
        assert r.finished, r
        if r.rid in aborted:
            assert r.finish_reason is FinishReason.ABORT
        else:
            assert r.finish_reason is FinishReason.LENGTH
            assert r.output_ids == [1000 + k for k in range(r.params.max_tokens)], r
    sim.assert_no_leak()
