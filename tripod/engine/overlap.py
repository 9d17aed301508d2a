"""The overlap scheduler: the next decode step is scheduled and laid out while the device still
computes this one (SGLang's overlap idea), without changing a single output.

A step's forward and its draws are queued on the device; before the host waits for the drawn
tokens (``Sampler.resolve``, the step's one device→host copy), ``Lookahead.prepare`` builds the
step that follows *if* this one's requests all keep decoding: every running request decoded in
this step, none can reach its length limit with this token, nobody waits to be admitted, no
drafts (speculative proposers, grammar jump-forward) ride on decodes, and one process runs the
model. It reserves each request's next KV slot and lays the batch out as ``Scheduler.schedule``
and ``ModelRunner.build_batch`` would, with one difference: the input ids are the device tensor of
this step's draws, gathered on the device, so the host never needs their values to launch the
next forward.

The prepared step is a guess about the scheduler's next decision: ``Lookahead.take`` adopts it
only when that decision is certain to be the same — the same running requests, none finished,
aborted, retracted or re-laid (``slots_version``), nobody waiting — and otherwise gives the
reserved slots back and lets the scheduler decide. Adoption changes no output: the batch holds
the same requests, positions, slots and (on the device) token ids as the one the scheduler would
have built, and a row's computation never depends on the rest of its batch. A stop token or a new
arrival costs one discarded layout on the host, never a wasted forward.

On a CPU the forward is synchronous, so this only reorders host work (``--overlap-schedule on``
runs it there, for the tests); on a GPU the launch returns at once and the layout of step k+1
runs beside step k's kernels (``auto``: on for the Triton backend on CUDA).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tripod.engine.model_runner import ModelRunner
from tripod.engine.request import Req
from tripod.engine.scheduler import ScheduledItem, Scheduler
from tripod.layers.batch import ForwardBatch, upload

_PLACEHOLDER = 0  # the input id a prepared row carries on the host; the device's draw replaces it


@dataclass(slots=True)
class Prepared:
    """A decode step laid out ahead of the scheduler: its items (in the scheduler's order), the
    built batch and its sampling rows, and each request's ``slots_version`` once its slot was
    reserved (a re-laid request cannot take it)."""

    items: list[ScheduledItem]
    batch: ForwardBatch
    sampling: list[ScheduledItem]
    versions: list[int]
    reserved: list[int]  # the slot each request got for its next token


@dataclass(slots=True)
class OverlapCounts:
    adopted: int = 0  # prepared steps that ran as prepared
    discarded: int = 0  # prepared steps given back (a stop, an arrival, an abort, ...)


@dataclass
class Lookahead:
    scheduler: Scheduler
    runner: ModelRunner
    drafts_possible: Callable[[Req], bool]  # whether a request may get drafts next step
    counts: OverlapCounts = field(default_factory=OverlapCounts)
    prepared: Prepared | None = None

    # ------------------------------------------------------------------ before the sync
    def prepare(self, items: list[ScheduledItem], sampling: list[ScheduledItem], tokens: torch.Tensor) -> None:
        """Lay out the decode step after ``items`` (this step's, whose draws ``tokens`` are still
        on the device, in ``sampling``'s row order), when the scheduler's next decision is known."""
        assert self.prepared is None, "a prepared step was neither adopted nor discarded"
        order = self._next_decodes(items, sampling)
        if order is None:
            return
        alloc = self.scheduler.allocator
        reserved: list[int] = []
        for req in order:
            new = alloc.alloc(1, req.dp_rank)
            assert new is not None, "a free slot counted by _next_decodes is gone"
            req.slots.extend(new)
            reserved.append(new[0])
        for req in order:  # the request as it will be once this step's token is committed
            req.output_ids.append(_PLACEHOLDER)
            req.computed += 1
        try:
            nxt = [ScheduledItem(req, req.computed, 1) for req in order]
            batch, rows = self.runner.build_batch(nxt)
        finally:
            for req in order:
                req.output_ids.pop()
                req.computed -= 1
        row_of = {id(it.req): j for j, it in enumerate(sampling)}
        gather = upload([row_of[id(req)] for req in order], torch.long, tokens.device)
        batch.input_ids = tokens.index_select(0, gather)
        self.prepared = Prepared(nxt, batch, rows, [req.slots_version for req in order], reserved)

    def _next_decodes(self, items: list[ScheduledItem], sampling: list[ScheduledItem]) -> list[Req] | None:
        """The requests of the next step, in the scheduler's order, if it will be this step's
        requests decoding one more token each; else None."""
        sched = self.scheduler
        if sched.waiting or not items or len(items) != len(sched.running) or len(sampling) != len(items):
            return None
        if not self.runner.lays_out_slot_table():
            return None  # the dense layouts keep per-step state (the decode mirror) a guess would move
        for it in items:
            req = it.req
            if it.verify or it.length != 1 or not it.samples or self.drafts_possible(req):
                return None
            if req.first_token_time is None:
                return None  # its first token's commit re-lays its slots (Scheduler.cache_prefix)
            if len(req.output_ids) + 1 >= req.params.max_tokens or req.seq_len + 1 >= req.max_len:
                return None  # this token may end it by length: the next step is not certain
        order = sched.decode_order()
        if {id(r) for r in order} != {id(it.req) for it in items}:
            return None
        ranks: dict[int, int] = {}
        for req in order:
            ranks[req.dp_rank] = ranks.get(req.dp_rank, 0) + 1
        if any(sched.allocator.free_on(rank) < n for rank, n in ranks.items()):
            return None  # the scheduler would evict or retract: let it
        return order

    # ------------------------------------------------------------------ the next step
    def take(self) -> Prepared | None:
        """The prepared step, if it is exactly what the scheduler would now schedule (counted as
        a scheduled step); else None, its reserved slots given back."""
        p, self.prepared = self.prepared, None
        if p is None:
            return None
        sched = self.scheduler
        reqs = [it.req for it in p.items]
        same = (not sched.waiting and len(sched.running) == len(reqs) and self.runner.backend is p.batch.backend
                and [id(r) for r in sched.decode_order()] == [id(r) for r in reqs]
                and all(r.finish_reason is None and r.seq_len - r.computed == 1 and r.slots_version == v
                        and len(r.slots) == r.seq_len for r, v in zip(reqs, p.versions, strict=True)))
        if not same:
            self.discard(p)
            return None
        sched.adopt(p.items)
        self.counts.adopted += 1
        return p

    def discard(self, p: Prepared | None = None) -> None:
        """Give back the slots reserved for a prepared step (requests released since hold none)."""
        p = p or self.prepared
        self.prepared = None
        if p is None:
            return
        self.counts.discarded += 1
        for it, slot in zip(p.items, p.reserved, strict=True):
            req = it.req
            if req.slots and len(req.slots) == req.computed + 1 and req.slots[-1] == slot:
                self.scheduler.allocator.free([req.slots.pop()])
                req.slots_version += 1  # the slot table re-reads the request's row
