"""How much to speculate: per request from its recent acceptance, per step from the batch size.

A draft token costs a row of the verification forward (and, for a draft model, a draft pass);
it pays only when accepted. So each request's draft length follows its acceptance: all accepted
→ one more next time (up to the configured maximum), some rejected → what was accepted plus one.
A request whose drafts keep failing pauses, for twice as long after each failed probe. And a step
that already decodes many requests has no compute to spare: above ``spec_max_batch`` decoding
requests nobody speculates (grammar-forced jump-forward excepted: its tokens are free to propose).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MISSES_BEFORE_PAUSE = 3
MAX_PAUSE = 64  # steps


@dataclass(slots=True)
class SpecState:
    """One request's speculation state (``Req.spec``)."""

    k: int  # draft length for the next round
    misses: int = 0  # consecutive rounds with nothing accepted
    pause: int = 0  # steps left without speculating
    pauses: int = 0  # pauses so far (each twice as long as the last)
    ngram: Any = None  # ngram.NgramIndex over the request's tokens
    rounds: int = 0
    proposed: int = 0
    accepted: int = 0


class AdaptivePolicy:
    def __init__(self, max_k: int, max_batch: int) -> None:
        self.max_k = max_k
        self.max_batch = max_batch

    def state(self, req: Any) -> SpecState:
        if req.spec is None:
            req.spec = SpecState(k=self.max_k)
        st: SpecState = req.spec
        return st

    def step_allows(self, decoding: int) -> bool:
        return decoding <= self.max_batch

    def wants(self, st: SpecState) -> bool:
        """Whether the request speculates this step (counts down a pause)."""
        if st.pause > 0:
            st.pause -= 1
            return False
        return True

    def update(self, st: SpecState, proposed: int, accepted: int) -> None:
        st.rounds += 1
        st.proposed += proposed
        st.accepted += accepted
        if accepted == proposed:
            st.k = min(self.max_k, st.k + 1)
        else:
            st.k = max(1, accepted + 1)
        if accepted == 0:
            st.misses += 1
            if st.misses >= MISSES_BEFORE_PAUSE:
                st.pause = min(MAX_PAUSE, 2 ** (st.pauses + 2))
                st.pauses += 1
                st.misses = 0
        else:
            st.misses = 0
            st.pauses = 0
