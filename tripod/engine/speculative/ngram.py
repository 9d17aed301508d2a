"""Prompt lookup: propose what followed the latest earlier occurrence of the request's last
n-gram, in its own prompt and output. No model, no training; pays off when the answer copies
from the input (summaries, rewrites, code edits) and costs nothing when nothing matches.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tripod.engine.speculative.proposer import Proposal, Proposer

if TYPE_CHECKING:
    from tripod.engine.request import Req
    from tripod.engine.scheduler import ScheduledItem


class NgramIndex:
    """For n in ``sizes``: n-gram → exclusive end of its latest occurrence, over the tokens
    seen so far except the current suffix (so a hit always points into the past)."""

    __slots__ = ("done", "grams", "sizes")

    def __init__(self, sizes: tuple[int, ...]) -> None:
        self.sizes = sizes  # longest first: a longer match predicts better
        self.grams: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in sizes}
        self.done = 0  # grams ending at positions < done are indexed

    def lookup(self, ids: list[int], k: int) -> list[int]:
        end = len(ids)
        for e in range(self.done, end):  # NOTE: never the gram ending at ``end`` (the suffix itself)
            for n in self.sizes:
                if e >= n:
                    self.grams[n][tuple(ids[e - n : e])] = e
        self.done = end
        for n in self.sizes:
            if end >= n:
                hit = self.grams[n].get(tuple(ids[end - n : end]))
                if hit is not None:
                    return ids[hit : hit + k]
        return []


class NgramProposer(Proposer):
    name = "ngram"

    def __init__(self, max_n: int = 4, min_n: int = 2) -> None:
        self.sizes = tuple(range(max_n, min_n - 1, -1))

    def propose(self, reqs: list[Req], lengths: list[int], items: list[ScheduledItem]) -> list[Proposal | None]:
        out: list[Proposal | None] = []
        for req, k in zip(reqs, lengths, strict=True):
            idx = req.spec.ngram  # the request's own index: it lives and dies with the request
            if idx is None:
                idx = req.spec.ngram = NgramIndex(self.sizes)
            toks = idx.lookup(req.all_ids, k)
            out.append(Proposal(toks) if toks else None)
        return out
