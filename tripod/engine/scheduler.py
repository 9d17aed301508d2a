"""Continuous batching: which requests run in the next forward pass, and with how many tokens.

Each step is built in this order, within a token budget:
1. every running request that is decoding (one token each);
2. running requests part-way through a chunked prefill (their next chunk);
3. new requests from the waiting queue, in policy order, while KV memory and the budget last.
   With several tenants the policy order is interleaved by tenant so that each gets compute in
   proportion to its weight (``engine/fairness.py``); with one, it is the policy's order as is.

KV memory never raises: a prefill that does not fit waits; a decode that does not fit first
evicts unpinned prefix-cache entries, then retracts the least important running request (its
KV is released and it is re-queued to be recomputed later, its output so far kept).

Fair preemption: when every running slot is taken and a tenant waits below its share of the
slots while another runs above its own (``FairShare.preemptions``), the over-share tenant's least
important request is retracted before the step is built (its computed KV goes into the prefix
cache, so resuming recomputes little) and the under-share request is admitted first. A tenant
under its share never waits behind one over it for a running request to finish.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from tripod.engine.fairness import FairShare
from tripod.engine.lora import LoraRegistry
from tripod.engine.request import FinishReason, Req
from tripod.memory.kv_pool import SlotAllocator
from tripod.memory.prefix_cache import MatchResult, PrefixCache
from tripod.memory.state_pool import StatePool
from tripod.memory.state_snapshots import StateSnapshots

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ScheduledItem:
    req: Req
    start: int  # position of the first token to compute (== req.computed)
    length: int  # tokens computed this step
    # Jump-forward verification: the item is the last sampled token plus draft tokens
    # (temporarily appended to the request), and every position gets logits.
    verify: bool = False

    @property
    def samples(self) -> bool:
        """Whether this step's forward ends the request's known tokens (so it samples)."""
        return self.start + self.length == self.req.seq_len


@dataclass(slots=True)
class SchedulePolicy:
    """Orders the waiting queue. ``priority`` (higher first) always dominates.

    - ``fcfs``: arrival order.
    - ``lpm``: longest cached prefix first, plus ``aging`` tokens of credit for every step a
      request has waited, so a request with no cache hit is never starved by a stream of hits.
    """

    name: str = "lpm"
    aging: float = 8.0

    def __post_init__(self) -> None:
        if self.name not in ("fcfs", "lpm"):
            raise ValueError(f"unknown scheduling policy {self.name!r}; use 'fcfs' or 'lpm'")

    def order(self, waiting: list[Req], cache: PrefixCache, step: int, enq: dict[str, int]) -> list[Req]:
        if self.name == "fcfs" or not cache.enabled or len(waiting) > 512:
            # Beyond a few hundred waiting requests prefix matching each step costs more than
            # it saves; fall back to arrival order (priority still first).
            return sorted(waiting, key=lambda r: (-r.params.priority, r.arrival))

        def score(r: Req) -> tuple[int, float, float]:
            hit = len(cache.match_prefix(r.cache_ids[:-1], record=False).slots)
            age = step - enq.get(r.rid, step)
            return (-r.params.priority, -(hit + self.aging * age), r.arrival)

        return sorted(waiting, key=score)


class Scheduler:
    """Owns the waiting and running queues and every request's KV slots.

    Invariant (checked by ``assert_consistent``): each KV slot is free, private to exactly one
    running request (``req.slots[req.cache_len:]``), or held by the prefix cache's tree. It talks
    to the cache through ``PrefixCache`` only (a disk tier under it is the cache's business), and
    to the engine's LoRA adapters (``loras``; None: it serves none) through their handles.
    """

    def __init__(
        self,
        allocator: SlotAllocator,
        cache: PrefixCache,
        *,
        max_running: int,
        max_batch_tokens: int,
        chunk_size: int,
        policy: SchedulePolicy,
        loras: LoraRegistry | None = None,
        states: StatePool | None = None,
        snapshots: StateSnapshots | None = None,
    ) -> None:
        self.allocator = allocator
        # Hybrid models: one recurrent-state slot per running request (taken at admission, given
        # back with its KV). A cached prefix is reused only from a node holding a state snapshot
        # (``_match``; none without ``snapshots``): exact by construction.
        self.states = states
        self.snapshots = snapshots
        self._snap: int | None = None  # the snapshot slot ``_match`` found for the request being placed
        self.cache = cache
        self.max_running = max_running
        self.max_batch_tokens = max_batch_tokens
        self.chunk_size = chunk_size
        self.policy = policy
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.step_count = 0
        self._enqueued_at: dict[str, int] = {}
        self.num_retractions = 0
        self.num_fair_preemptions = 0
        self.fair = FairShare()
        self.loras = loras
        self._promoted: list[Req] = []  # under-share requests a fair preemption made room for

    # ------------------------------------------------------------------ queue
    def add(self, req: Req) -> None:
        self.waiting.append(req)
        self._enqueued_at[req.rid] = self.step_count
        self.fair.join(req)
        self.cache.prefetch(req.cache_ids[:-1])  # a tier below the pool reads its prefix meanwhile

    def abort(self, req: Req) -> None:
        """Finish ``req`` as aborted and release its KV (no-op if already finished)."""
        if req.finished:
            return
        if req in self.waiting:
            self.waiting.remove(req)
            self._enqueued_at.pop(req.rid, None)
            if req in self._promoted:
                self._promoted.remove(req)
        elif req in self.running:
            self.running.remove(req)
            self.release(req, keep=True)
        req.finish_reason = FinishReason.ABORT

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ one step
    def schedule(self) -> list[ScheduledItem]:
        if len(self.fair.vtime) > 1:
            self.fair.forget_idle(self.waiting + self.running)
        items = self._schedule()
        for it in items:
            self.fair.charge(it.req.tenant, it.length)
        return items

    def decode_order(self) -> list[Req]:
        """The running requests in the order a step's decodes are scheduled (most important first)."""
        return sorted(self.running, key=self._importance, reverse=True)

    def adopt(self, items: list[ScheduledItem]) -> None:
        """Count ``items`` — a decode step laid out ahead (engine/overlap.py), their slots already
        reserved — as this step's schedule, with the same bookkeeping ``schedule`` does."""
        if len(self.fair.vtime) > 1:
            self.fair.forget_idle(self.waiting + self.running)
        self.step_count += 1
        for it in items:
            self.fair.charge(it.req.tenant, it.length)

    def _schedule(self) -> list[ScheduledItem]:
        self.step_count += 1
        items: list[ScheduledItem] = []
        budget = self.max_batch_tokens
        self._preempt_for_fairness()  # NOTE: before any item is built: a victim is in no item

        # 1. Decodes. Iterate over a snapshot: retraction removes from self.running.
        for req in self.decode_order():
            if req not in self.running or req.seq_len - req.computed != 1:
                continue
            if not self._reserve(req, 1, may_retract=True):
                continue  # req itself was retracted
            items.append(ScheduledItem(req, req.computed, 1))
            budget -= 1

        # 2. Prefills already under way.
        for req in self.running:
            if budget <= 0:
                break
            left = req.seq_len - req.computed
            if left <= 1 or any(it.req is req for it in items):
                continue
            n = _chunk(req, req.computed, min(left, self.chunk_size, budget))
            fitted = self._fit(n, req.dp_rank)
            n = _chunk(req, req.computed, fitted)
            n = n if n <= fitted else 0  # (an image computed whole does not fit yet)
            if n <= 0:
                if self.allocator.ranks > 1:
                    continue  # its rank is full; another rank's prefill may still fit
                break
            self._reserve(req, n, may_retract=False)
            items.append(ScheduledItem(req, req.computed, n))
            budget -= n

        # 3. Admissions.
        if budget > 0 and self.waiting and len(self.running) < self.max_running:
            ordered = self.fair.order(self.policy.order(self.waiting, self.cache, self.step_count, self._enqueued_at))
            ordered = self.fair.slot_order(ordered, self.running, self.max_running)
            self._promoted = [r for r in self._promoted if r in self.waiting]
            for req in self._promoted + [r for r in ordered if r not in self._promoted]:
                if budget <= 0 or len(self.running) >= self.max_running:
                    break
                if req.wait_for is not None and not _sibling_ready(req.wait_for):
                    continue
                if self._stale_adapter(req):
                    continue
                item = self._admit(req, budget)
                if item is None:
                    break  # out of KV memory: keep the order, wait for memory
                items.append(item)
                budget -= item.length
        if not items and self.running:
            # Every running request is part-way through a prefill and memory is full: give
            # one up so the others can finish (a lone request always fits: max_len caps it).
            self.retract(min(self.running, key=self._importance))
            return self._schedule()
        return items

    def _importance(self, req: Req) -> tuple[int, float, int]:
        # Higher priority, then earlier arrival, is more important (retracted last).
        return (req.params.priority, -req.arrival, -req.seq)

    def _stale_adapter(self, req: Req) -> bool:
        """A request whose LoRA adapter was unloaded (or replaced under its name) while it waited
        is refused, not run on other weights (nor cached under the old adapter's namespace)."""
        if req.lora is None or req.adapter is not None:
            return False
        assert self.loras is not None
        if self.loras.current(req.lora):
            return False
        self.waiting.remove(req)
        self._enqueued_at.pop(req.rid, None)
        if req in self._promoted:
            self._promoted.remove(req)
        req.error = (f"the LoRA adapter {req.lora.name!r} was unloaded or replaced while the request waited; "
                     "send it again")
        req.finish_reason = FinishReason.ERROR
        return True

    def _admit(self, req: Req, budget: int) -> ScheduledItem | None:
        if req.lora is None or req.adapter is not None:
            return self._place(req, budget)
        assert self.loras is not None
        req.adapter = self.loras.acquire(req.lora)  # held while it runs (given back in release)
        if req.adapter is None:
            return None  # every resident adapter is held by running requests: wait
        item = self._place(req, budget)
        if item is None:  # not admitted after all: it waits without holding the adapter
            self.loras.release(req.lora)
            req.adapter = None
        return item

    def _place(self, req: Req, budget: int) -> ScheduledItem | None:
        if self.states is not None and self.states.num_free == 0:
            return None  # every state slot is held by a running request: wait for one
        tokens = req.cache_ids
        # What a tier below the pool has beyond the pool's match goes into the pool first.
        self.cache.load(tokens[:-1], headroom=len(self.running), chunk=min(self.chunk_size, budget),
                        record=req.retractions == 0)
        match = self._match(req)
        rank = match.rank
        # Lock before allocating: eviction below must not take the prefix we just matched.
        self.cache.lock(match.node)
        hit = len(match.slots)
        n = _chunk(req, hit, min(len(tokens) - hit, self.chunk_size, budget))
        # Headroom: leave room for every running request's next decode token (on this rank).
        mates = self._on(rank)
        headroom = len(mates)
        if self._available(rank) < n + headroom:
            self.cache.evict(n + headroom - self._available(rank), rank)
        if self._available(rank) < n + headroom:
            take = _chunk(req, hit, min(n, self._available(rank))) if not mates else 0
            if 0 < take <= self._available(rank):
                n = take  # alone on its rank: take what there is
            else:
                self.cache.unlock(match.node)
                return None
        new = self.allocator.alloc(n, rank)
        assert new is not None
        self.waiting.remove(req)
        self._enqueued_at.pop(req.rid, None)
        if req in self._promoted:
            self._promoted.remove(req)
        req.dp_rank = rank
        if self.states is not None:
            req.state_slot = self.states.alloc()  # zeroed: the sequence starts from the empty state
            assert req.state_slot is not None
            if hit:  # resume from the snapshot of the node the hit ends on
                assert self.snapshots is not None and self._snap is not None
                self.snapshots.restore(self._snap, self.states, req.state_slot)
        req.slots = match.slots + new
        req.slots_version += 1
        req.cache_len = hit
        req.last_node = match.node
        req.computed = hit
        if req.retractions == 0:
            req.cached_tokens = hit
        self.running.append(req)
        return ScheduledItem(req, hit, n)

    def _match(self, req: Req) -> MatchResult:
        """The request's cached prefix; data-parallel attention: on the rank that holds the
        longest one, else (no hit) the rank with the fewest running requests, then the most free slots."""
        record = req.retractions == 0
        if req.routed is not None:  # return_routed_experts: the prompt is routed here, never taken from the cache
            return self.cache.match_prefix([], record=False)
        if self.states is not None:
            return self._hybrid_match(req, record)
        if self.allocator.ranks == 1:
            return self.cache.match_prefix(req.cache_ids[:-1], record=record)
        found = [self.cache.match_prefix(req.cache_ids[:-1], record=False, rank=r) for r in range(self.allocator.ranks)]
        best = max(found, key=lambda m: (len(m.slots), -len(self._on(m.rank)), self.allocator.free_on(m.rank)))
        if record:
            self.cache.record(len(req.all_ids) - 1, len(best.slots))
        return best

    def _hybrid_match(self, req: Req, record: bool) -> MatchResult:
        """A hybrid model's hit: the deepest node of the cached prefix that holds a state snapshot
        (a prefix's K/V alone cannot resume the recurrent layers)."""
        query = req.cache_ids[:-1]
        found = None
        if self.snapshots is not None:
            found = self.snapshots.find(self.cache.match_prefix(query, record=False).node)
        self._snap = found[1] if found is not None else None
        match = (MatchResult(found[0].path_value(), found[0]) if found is not None
                 else self.cache.match_prefix([], record=False))
        if record:
            self.cache.record(len(query), len(match.slots))
        return match

    def _on(self, rank: int) -> list[Req]:
        """The running requests whose attention runs on ``rank`` (every one with a single rank)."""
        if self.allocator.ranks == 1:
            return self.running
        return [r for r in self.running if r.dp_rank == rank]

    def _available(self, rank: int = 0) -> int:
        return self.allocator.free_on(rank)

    def _fit(self, n: int, rank: int) -> int:
        """Largest chunk <= n that memory allows (evicting cache if needed)."""
        if self._available(rank) < n:
            self.cache.evict(n - self._available(rank), rank)
        return min(n, self._available(rank))

    def _reserve(self, req: Req, n: int, *, may_retract: bool) -> bool:
        """Allocate ``n`` slots onto ``req``'s private tail; retract others (on its rank) if allowed."""
        rank = req.dp_rank
        while True:
            if self._available(rank) < n:
                self.cache.evict(n - self._available(rank), rank)
            new = self.allocator.alloc(n, rank)
            if new is not None:
                req.slots.extend(new)
                return True
            assert may_retract, "prefill chunk sized beyond free memory"
            victim = min(self._on(rank), key=self._importance)
            self.retract(victim)
            if victim is req:
                return False

    def _preempt_for_fairness(self) -> None:
        """Make room in a full running batch for waiting requests of tenants under their share of
        the slots, by retracting requests of tenants over theirs (``FairShare.preemptions``)."""
        if len(self.running) < self.max_running or not self.waiting or len(self.fair.vtime) < 2:
            return
        if not self.fair.someone_over(self.waiting, self.running, self.max_running):
            return  # the common case under contention once shares are reached: nothing to do
        eligible = [r for r in self.waiting if r.wait_for is None or _sibling_ready(r.wait_for)]
        # NOTE: arrival order within a tenant (priority first), not the policy's: lpm's prefix
        # matching of the whole queue is not worth repeating for the choice of who is promoted.
        ordered = self.fair.order(sorted(eligible, key=lambda r: (-r.params.priority, r.arrival)))
        for needy, victim in self.fair.preemptions(ordered, self.running, self.max_running, self._importance):
            self.retract(victim, keep=True)
            self.num_fair_preemptions += 1
            if needy not in self._promoted:
                self._promoted.append(needy)

    def retract(self, req: Req, *, keep: bool = False) -> None:
        """Release a running request's KV and re-queue it (its outputs are kept). ``keep``: its
        computed tokens go into the prefix cache (a fair preemption; memory pressure frees them)."""
        log.info("retracting %s to %s", req.rid, "make room for a tenant under its share" if keep else "free KV memory")
        self.running.remove(req)
        self.release(req, keep=keep)
        req.retractions += 1
        self.num_retractions += 1
        self.waiting.insert(0, req)
        self._enqueued_at[req.rid] = self.step_count - 10_000  # first in line when memory frees

    # ------------------------------------------------------------------ KV bookkeeping
    def cache_prefix(self, req: Req) -> None:
        """After a prefill chunk: put the computed tokens into the tree so that others (and
        ``n`` > 1 siblings) can share them, and re-pin the request on the new node."""
        if not self.cache.enabled:
            return
        k = req.computed
        tokens = req.cache_ids[:k]
        present, _ = self.cache.insert(tokens, req.slots[:k])
        match = self.cache.match_prefix(tokens, record=False, rank=req.dp_rank)
        assert len(match.slots) == k
        # Slots in [cache_len, present) duplicate entries someone else inserted meanwhile.
        self.allocator.free(req.slots[req.cache_len : present])
        self.cache.lock(match.node)
        if req.last_node is not None:
            self.cache.unlock(req.last_node)
        req.slots[:k] = match.slots
        req.slots_version += 1
        req.cache_len = k
        req.last_node = match.node
        if self.snapshots is not None and req.state_slot is not None:
            assert self.states is not None
            self.snapshots.put(match.node, self.states, req.state_slot)  # the state after these k tokens

    def release(self, req: Req, *, keep: bool) -> None:
        """Give back ``req``'s KV. ``keep``: its computed tokens go into the prefix cache."""
        if keep and self.cache.enabled and req.computed > 0:
            self.cache_prefix(req)
        if req.last_node is not None:
            self.cache.unlock(req.last_node)
        private = req.slots[req.cache_len :]
        if private:
            self.allocator.free(private)
        if req.adapter is not None:
            assert self.loras is not None and req.lora is not None
            self.loras.release(req.lora)
            req.adapter = None
        if req.state_slot is not None:
            assert self.states is not None
            self.states.free(req.state_slot)
            req.state_slot = None
        req.slots = []
        req.slots_version += 1
        req.cache_len = 0
        req.last_node = None
        req.computed = 0

    def finish(self, req: Req, reason: FinishReason) -> None:
        req.finish_reason = reason
        if req in self.running:
            self.running.remove(req)
        self.release(req, keep=True)

    # ------------------------------------------------------------------ checks
    def assert_consistent(self) -> None:
        """Every slot is free, private to exactly one running request, or in the tree."""
        self.cache.check_tree()
        owner: dict[int, str] = {}
        for s in self.allocator.free_set():
            owner[s] = "free"
        for s in self.cache.slots_in_tree():
            assert s not in owner, f"slot {s} is both {owner[s]} and in the tree"
            owner[s] = "tree"
        for r in self.running:
            assert len(r.slots) >= r.computed and r.cache_len <= r.computed
            for s in r.slots[r.cache_len :]:
                assert s not in owner, f"slot {s} of {r.rid} is also {owner[s]}"
                owner[s] = r.rid
            assert all(self.allocator.rank_of(s) == r.dp_rank for s in r.slots), (
                f"{r.rid} runs on rank {r.dp_rank} but holds another rank's slots")
        for r in self.waiting:
            assert not r.slots and r.last_node is None, f"waiting {r.rid} holds KV"
        assert len(owner) == self.allocator.num_slots, (
            f"{self.allocator.num_slots - len(owner)} KV slots are owned by nobody (leaked)"
        )
        if not self.running:
            assert self.cache.protected_size == 0, "idle engine with pinned cache nodes"
        if self.states is not None:  # every state slot is free or held by exactly one running request
            held = [r.state_slot for r in self.running]
            assert None not in held, "a running request of a hybrid model holds no state slot"
            assert len(set(held)) == len(held), f"a state slot is held twice: {held}"
            assert not set(held) & self.states.free_set(), "a held state slot is also free"
            assert len(held) + self.states.num_free == self.states.num_slots, "state slots leaked"
            assert all(r.state_slot is None for r in self.waiting), "a waiting request holds a state slot"


def _chunk(req: Req, start: int, n: int) -> int:
    """A prefill chunk's length: ``n``, or moved to an image boundary where the model computes an
    image's tokens together (``PromptImages.chunk``: Gemma 3's bidirectional images)."""
    return n if req.images is None else req.images.chunk(start, n)


def _sibling_ready(parent: Req) -> bool:
    # The first copy has computed its whole prompt (and put it into the cache), or is gone.
    return parent.finished or parent.computed >= len(parent.prompt_ids)
