"""How much to speculate: a cost model, measured as the engine runs.

A round with k draft tokens at per-token acceptance a yields E(a, k) = 1 + a + … + a^k tokens
(the accepted run plus the token the target samples after it) instead of 1, and adds to the
step Δ(k) = k · (one more verification row + the request's share of a draft pass). The policy
fits the target's decode step time as a line in the step's rows, t(rows) = t0 + t1 · rows
(measured on every decode step, forgetting old ones), and measures each draft model's pass
time. With B requests decoding, a request's k drafts raise the batch's throughput by the factor
(B + E − 1) · t(B) / (B · (t(B) + Δ(k))); per request and step the policy takes the k in
[1, max] with the best factor and speculates only if it beats plain decoding by ``MARGIN``.
So free drafts (n-gram, grammar) run long at small batches and fade out as the batch grows
(each verification row then costs what a decode row costs), and a draft model speculates only
where its acceptance pays for its passes.

Acceptance is tracked per request (starting from the proposer's running average, so once a
proposer is known not to pay, new requests don't try it either); a request that should not
speculate pauses, for twice as long each time (up to ``MAX_PAUSE`` steps), then probes one round
with k = 1 to refresh its estimate. Probes are exploration and get a budget: at most
``EXPLORE_SHARE`` of the engine's time (a separate draft model's probe first catches up on every
token it missed, which costs a prefill of them); past it a due probe waits. Above ``spec_max_batch`` decoding requests nobody speculates
(grammar-forced jump-forward excepted: its tokens cost nothing to propose).
``adaptive=False`` always drafts the maximum (tests, and measuring a proposer's acceptance).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MARGIN = 1.05  # speculate only for an expected gain of at least 5 %
MAX_PAUSE = 64  # steps
PROBE_RETRY = 8  # steps a due probe waits when the exploration budget is spent
EXPLORE_SHARE = 0.02  # of the engine's time, at most, on probes
LATE_PAUSES = 3  # a new request of a proposer that does not pay starts at the 4th pause (32 steps)
REQ_EMA = 0.5  # weight of the newest round in a request's acceptance
PROPOSER_EMA = 0.1  # ... and in the proposer's running average
STEP_EMA = 0.1  # ... in the measured draft-pass times


@dataclass(slots=True)
class SpecState:
    """One request's speculation state (``Req.spec``)."""

    alpha: float  # estimated per-token acceptance
    pause: int = 0  # steps left without speculating
    pauses: int = 0  # pauses so far (each twice as long as the last)
    probe: bool = False  # the next round probes with one draft token
    probing: bool = False  # this round is a probe
    ngram: Any = None  # ngram.NgramIndex over the request's tokens
    rounds: int = 0
    proposed: int = 0
    accepted: int = 0


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a round of k drafts yields at per-token acceptance ``alpha``."""
    return float(k + 1) if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


class StepModel:
    """t(rows) = t0 + t1 · rows, a least-squares line over recent decode steps (old ones fade)."""

    PRIOR_SLOPE = 0.08  # t1 / t(1) before steps of different sizes have been seen (2 CPU cores)

    def __init__(self, decay: float = 0.98) -> None:
        self.decay = decay
        self.w = self.x = self.y = self.xx = self.xy = 0.0

    def observe(self, rows: int, seconds: float) -> None:
        d = self.decay
        self.w = d * self.w + 1.0
        self.x = d * self.x + rows
        self.y = d * self.y + seconds
        self.xx = d * self.xx + rows * rows
        self.xy = d * self.xy + rows * seconds

    @property
    def known(self) -> bool:
        return self.w > 0.0

    def line(self) -> tuple[float, float]:
        mx, my = self.x / self.w, self.y / self.w
        var = self.xx / self.w - mx * mx
        if var > 0.25:  # rows varied enough to see the slope
            slope = max(0.0, (self.xy / self.w - mx * my) / var)
        else:
            slope = self.PRIOR_SLOPE * my / (1.0 + self.PRIOR_SLOPE * mx)
        return max(my - slope * mx, 0.0), slope


class AdaptivePolicy:
    def __init__(self, max_k: int, max_batch: int, adaptive: bool = True, prior: float = 0.7) -> None:
        self.max_k = max_k
        self.max_batch = max_batch
        self.adaptive = adaptive
        self.prior = prior  # acceptance assumed before a proposer has any history
        self.alpha: dict[str, float] = {}  # per proposer: running acceptance
        self.steps = StepModel()
        self.pass_seconds: dict[str, float] = {}  # per proposer: a draft pass, per request (EMA)
        self.total_seconds = 0.0  # the engine's forward and proposal time
        self.explore_seconds = 0.0  # of which, proposals that were all probes

    # ------------------------------------------------------------------ measuring
    def observe_step(self, rows: int, seconds: float) -> None:
        self.steps.observe(rows, seconds)

    def observe_pass(self, proposer: str, seconds_per_request: float) -> None:
        s = self.pass_seconds.get(proposer)
        v = seconds_per_request
        self.pass_seconds[proposer] = v if s is None else (1 - STEP_EMA) * s + STEP_EMA * v

    def gain(self, alpha: float, k: int, batch: int, proposer: str) -> float:
        """The factor by which k drafts for one of ``batch`` decoding requests change the
        batch's tokens per second (1: no change)."""
        if not self.steps.known:
            return expected_tokens(alpha, k)  # nothing measured yet: drafts look free
        batch = max(1, batch)  # a step of prefill chunks only: as if this request decoded alone
        t0, t1 = self.steps.line()
        base = t0 + t1 * batch
        if base <= 0.0:
            return expected_tokens(alpha, k)
        delta = k * (t1 + self.pass_seconds.get(proposer, 0.0))
        return (batch + expected_tokens(alpha, k) - 1.0) * base / (batch * (base + delta))

    # ------------------------------------------------------------------ deciding
    def pays(self, proposer: str, batch: int) -> bool:
        """Whether the proposer's record says speculating pays at this batch size now."""
        if not self.adaptive:
            return True
        a = self.alpha.get(proposer, self.prior)
        return any(self.gain(a, k, batch, proposer) > MARGIN for k in range(1, self.max_k + 1))

    def state(self, req: Any, proposer: str, batch: int = 1) -> SpecState:
        if req.spec is None:
            st = req.spec = SpecState(alpha=self.alpha.get(proposer, self.prior))
            if not self.pays(proposer, batch):
                # Known not to pay: start with a long pause (later probes may still prove it does).
                st.pauses = LATE_PAUSES
                st.pause = min(MAX_PAUSE, 2 ** (st.pauses + 2))
        st = req.spec
        return st

    def step_allows(self, decoding: int) -> bool:
        return decoding <= self.max_batch

    def plan(self, st: SpecState, proposer: str, batch: int = 1) -> int:
        """Draft tokens for the request this step, one of ``batch`` decoding (0: plainly)."""
        if not self.adaptive:
            return self.max_k
        if st.pause > 0:
            st.pause -= 1
            st.probe = st.pause == 0
            return 0
        if st.probe:
            if self.explore_seconds > EXPLORE_SHARE * self.total_seconds:
                st.pause = PROBE_RETRY  # over the exploration budget: later
                return 0
            st.probe = False
            st.probing = True
            return 1
        st.probing = False
        best_k, best = 0, MARGIN
        for k in range(1, self.max_k + 1):
            g = self.gain(st.alpha, k, batch, proposer)
            if g > best:
                best_k, best = k, g
        if best_k == 0:
            st.pause = min(MAX_PAUSE, 2 ** (st.pauses + 2))
            st.pauses += 1
        else:
            st.pauses = 0  # it pays again: the next pause starts short
        return best_k

    def update(self, st: SpecState, proposer: str, proposed: int, accepted: int) -> None:
        st.rounds += 1
        st.proposed += proposed
        st.accepted += accepted
        a = accepted / proposed if proposed else 0.0
        st.alpha = (1 - REQ_EMA) * st.alpha + REQ_EMA * a
        g = self.alpha.get(proposer, self.prior)
        self.alpha[proposer] = (1 - PROPOSER_EMA) * g + PROPOSER_EMA * a
