"""A draft model as a proposer: a smaller model with the same tokenizer (``draft:PATH``), or this
model's own first K layers and head (``self:K``), run by the same engine over the same KV slots.

KV: a draft token's slot is the slot the target verifies it in, so the draft's K/V share the
target's slot ids and the one allocator (the same pool accounting, and the radix cache's slots
carry the draft's K/V too). ``self:K`` shares the target's pool outright: its layers are the
target's first K, so the target's own prefill and verification already wrote them. A separate
draft model has a pool of its own (same slot ids, its own layers), kept in step with the
target's prefill chunks, and caught up on what it missed (tokens decoded while speculation was
off, a verification's last accepted token) before it proposes. Which slots hold draft K/V for
which token is stamped per slot (token id and position), so a prefix from the radix cache is
reused when its draft K/V were computed and recomputed when not. A stale stamp can only cost
acceptance, never correctness: the target checks every draft token.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from tripod.engine.sampler import Sampler
from tripod.engine.scheduler import ScheduledItem
from tripod.engine.speculative.proposer import Proposal, Proposer

if TYPE_CHECKING:
    from tripod.engine.model_runner import ModelRunner
    from tripod.engine.request import Req


class DraftModelProposer(Proposer):
    writes_kv = True

    def __init__(self, name: str, runner: ModelRunner, sampler: Sampler, *, shares_kv: bool, catch_up: int) -> None:
        self.name = name
        self.runner = runner
        self.sampler = sampler
        self.shares_kv = shares_kv
        self.catch_up = catch_up  # most tokens the draft computes for one request in one pass
        n = runner.pool.num_slots
        self._tok = np.full(n, -1, dtype=np.int64)  # per slot: the token its draft K/V are of
        self._pos = np.full(n, -1, dtype=np.int64)  # ... and at which position
        self.draft_passes = 0
        self.draft_seconds = 0.0

    # ------------------------------------------------------------------ draft KV bookkeeping
    def _computed(self, req: Req, cap: int) -> int:
        """How many of the request's first ``cap`` tokens have valid draft K/V in their slots."""
        n = min(cap, len(req.slots))
        if n <= 0:
            return 0
        slots = np.fromiter(req.slots[:n], dtype=np.int64, count=n)
        ids = np.fromiter(req.all_ids[:n], dtype=np.int64, count=n)
        ok = (self._tok[slots] == ids) & (self._pos[slots] == np.arange(n))
        bad = np.flatnonzero(~ok)
        return int(bad[0]) if bad.size else n

    def _stamp(self, items: list[ScheduledItem]) -> None:
        if self.shares_kv:
            return
        for it in items:
            r, s, n = it.req, it.start, it.length
            slots = np.fromiter(r.slots[s : s + n], dtype=np.int64, count=n)
            self._tok[slots] = r.all_ids[s : s + n]
            self._pos[slots] = np.arange(s, s + n)

    def _forward(self, items: list[ScheduledItem]) -> dict[int, torch.Tensor]:
        """Run the draft over ``items``; the logits row of each item that samples, by id(item)."""
        t0 = time.perf_counter()
        logits, sampling = self.runner.forward(items)
        self._stamp(items)
        self.draft_passes += 1
        self.draft_seconds += time.perf_counter() - t0
        return {id(it): logits[j] for j, it in enumerate(sampling)}

    # ------------------------------------------------------------------ proposing
    def propose(self, reqs: list[Req], lengths: list[int], items: list[ScheduledItem]) -> list[Proposal | None]:
        proposing = {id(r) for r in reqs}
        first: list[ScheduledItem] = []
        if not self.shares_kv:
            # Prefill chunks of requests that may speculate later: the draft keeps pace.
            for it in items:
                r = it.req
                if id(r) in proposing or it.length == 1 or it.verify or not r.params.speculative:
                    continue
                end = it.start + it.length
                dc = self._computed(r, it.start)
                if end - dc <= self.catch_up:
                    first.append(ScheduledItem(r, dc, end - dc))
        heads: list[ScheduledItem | None] = []
        for r in reqs:
            last = r.seq_len - 1  # its slot is reserved (a decode item), its K/V not yet computed
            dc = last if self.shares_kv else self._computed(r, last)
            if r.seq_len - dc > self.catch_up:  # far behind: catch up now, propose next time
                first.append(ScheduledItem(r, dc, self.catch_up))
                heads.append(None)
                continue
            head = ScheduledItem(r, dc, r.seq_len - dc)
            first.append(head)
            heads.append(head)
        if not first:
            return []
        passes0, seconds0 = self.draft_passes, self.draft_seconds
        rows = self._forward(first)
        first_pass = self.draft_seconds - seconds0  # catch-up and shadowed chunks: not a draft's cost

        active = [i for i, h in enumerate(heads) if h is not None]

        def step(active: list[int]) -> dict[int, torch.Tensor]:
            items = [ScheduledItem(reqs[i], reqs[i].seq_len - 1, 1) for i in active]
            rows = self._forward(items)
            return {i: rows[id(it)] for i, it in zip(active, items, strict=True)}

        out, _ = chain_drafts(self.sampler, reqs, lengths, {i: rows[id(heads[i])] for i in active}, step)  # type: ignore[arg-type]
        if reqs and self.draft_passes > passes0 + 1:
            later = (self.draft_seconds - seconds0 - first_pass) / (self.draft_passes - passes0 - 1)
            self.last_pass_seconds = later / len(reqs)  # per request: a pass is shared by the batch
        return out


def chain_drafts(
    sampler: Sampler,
    reqs: list[Req],
    lengths: list[int],
    first: dict[int, torch.Tensor],
    step: Callable[[list[int]], dict[int, torch.Tensor]],
) -> tuple[list[Proposal | None], int]:
    """Draft ``lengths[i]`` tokens for the requests ``first`` has a logits row for (by index):
    pick a token from each row; while a request wants more, its draft so far is appended to its
    ``output_ids`` (the next pass reads it, and a seeded request's noise is drawn at its position)
    and ``step(active)`` gives the next rows. Returns the proposals (None where a request got
    none) and how many ``step`` passes ran; ``output_ids`` are restored."""
    toks: list[list[int]] = [[] for _ in reqs]
    probs: list[list[torch.Tensor]] = [[] for _ in reqs]
    active = sorted(first)
    logit_of = dict(first)
    added = [0] * len(reqs)
    passes = 0
    try:
        while active:
            for i in active:
                t, q = pick_draft(sampler, reqs[i], logit_of[i])
                toks[i].append(t)
                if q is not None:
                    probs[i].append(q)
            active = [i for i in active if len(toks[i]) < lengths[i]]
            if not active:
                break
            for i in active:
                reqs[i].output_ids.append(toks[i][-1])
                added[i] += 1
            logit_of = step(active)
            passes += 1
    finally:
        for i, r in enumerate(reqs):
            if added[i]:
                del r.output_ids[len(r.output_ids) - added[i] :]
    out: list[Proposal | None] = [
        Proposal(toks[i], torch.stack(probs[i]) if probs[i] else None) if len(toks[i]) == lengths[i] else None
        for i in range(len(reqs))
    ]
    return out, passes

def pick_draft(s: Sampler, req: Req, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
    """A draft's token at one position (and its distribution when drawn without a seed)."""
    adjusted = s.adjust(logits.unsqueeze(0), [req])
    if req.params.greedy:
        return int(adjusted.argmax()), None
    if req.noise_key is not None:
        # NOTE: a seeded request's draft draws with the very noise the target will draw with
        # at this position (counter-based: a function of the seed and the position, and the
        # draft's guesses are in output_ids), so it guesses the target's sample whenever
        # their distributions agree.
        return int(s.race(s.probs(adjusted, [req]), [req])[0]), None
    p = s.probs(adjusted, [req])[0]
    p = p / p.sum()
    return s.draw(p), p
