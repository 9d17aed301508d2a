"""Latency as the router's clients see it: time to first token (TTFT) and time per output token
(TPOT) of every answer the router proxies, kept for a while so that an SLO autoscaler can read
p95s over its look-back window, and exported as histograms on the router's ``/metrics``.

What is measured where (``Router.forward``): a stream's TTFT is the time from the request's
arrival at the router to the first byte of the answer (queueing for a replica included); its
TPOT is the time from that byte to the last, over the events after the first. A whole
(non-streamed) answer shows only its end: it gives a TPOT (latency / completion tokens, an upper
bound) and no TTFT. Requests that arrived while no replica was routable ("held": a cold start)
are counted apart, with the TTFT they saw, and left out of the p95 the autoscaler reads (that
wait is the cold start, reported as such).
"""

from __future__ import annotations

import json
import math
from collections import deque
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128)
_MAX_SAMPLES = 50_000
_TPOT_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)


def percentile(values: list[float], q: float) -> float | None:
    """The ``q`` quantile (nearest rank) of ``values``; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


class LatencyWindow:
    """Owns the timestamped samples of the last ``horizon`` seconds (arrivals, completions, TTFT and
    TPOT in seconds) and the router's latency series. Touched only from the router's event loop."""

    def __init__(self, registry: CollectorRegistry, clock: Callable[[], float], horizon: float = 600.0) -> None:
        self.clock = clock
        self.horizon = horizon
        # NOTE: bounded: past _MAX_SAMPLES in the horizon the oldest go first (a p95 of the latest
        # 50k answers is as good, and reading it stays cheap at every autoscaler tick).
        self.arrivals: deque[float] = deque(maxlen=_MAX_SAMPLES)
        self.completions: deque[float] = deque(maxlen=_MAX_SAMPLES)
        self.ttft: deque[tuple[float, float]] = deque(maxlen=_MAX_SAMPLES)
        self.tpot: deque[tuple[float, float]] = deque(maxlen=_MAX_SAMPLES)
        self.held: list[dict[str, float]] = []  # the last requests held for a cold start
        self.ttft_hist = Histogram("tripod:router_time_to_first_token_seconds",
                                   "streams: arrival at the router to the answer's first byte", buckets=_BUCKETS,
                                   registry=registry)
        self.tpot_hist = Histogram("tripod:router_time_per_output_token_seconds",
                                   "time per output token of proxied answers", buckets=_TPOT_BUCKETS,
                                   registry=registry)
        self.held_count = Counter("tripod:router_held_requests",
                                  "requests that arrived with no routable replica and waited for one (cold start)",
                                  registry=registry)
        self.held_ttft = Gauge("tripod:router_held_request_ttft_seconds",
                               "the last held request's time to first token (or whole answer)", registry=registry)

    def _trim(self, now: float) -> None:
        edge = now - self.horizon
        for q in (self.arrivals, self.completions):
            while q and q[0] < edge:
                q.popleft()
        for s in (self.ttft, self.tpot):
            while s and s[0][0] < edge:
                s.popleft()

    def arrived(self, at: float | None = None) -> float:
        now = self.clock() if at is None else at
        self.arrivals.append(now)
        self._trim(now)
        return now

    def first_byte(self, t0: float, held: bool) -> float:
        """A stream's first byte for a request that arrived at ``t0``; returns now."""
        now = self.clock()
        self.ttft_hist.observe(now - t0)
        if held:
            self._held(now - t0)
        else:
            # NOTE: a held request's TTFT is the cold start (reported as such), not the fleet's
            # latency: counted in the SLO's p95 it would make every scale from zero a scale-up.
            self.ttft.append((now, now - t0))
        return now

    def finished(self, t0: float, first: float | None, tokens: int, held: bool) -> None:
        """An answer ended: ``first`` is its first byte (streams), ``tokens`` what it produced."""
        now = self.clock()
        self.completions.append(now)
        if first is None and held:
            self._held(now - t0)
        start = first if first is not None else t0
        per = tokens - 1 if first is not None else tokens
        if per > 0:
            tpot = (now - start) / per
            self.tpot.append((now, tpot))
            self.tpot_hist.observe(tpot)
        self._trim(now)

    def _held(self, seconds: float) -> None:
        self.held_count.inc()
        self.held_ttft.set(seconds)
        self.held.append({"at": round(self.clock(), 3), "ttft_s": round(seconds, 3)})
        del self.held[:-20]

    # ------------------------------------------------------------ reading
    def p95_ms(self, kind: str, lookback: float) -> float | None:
        """The p95 of ``kind`` ("ttft" or "tpot") over the last ``lookback`` s, in ms."""
        edge = self.clock() - lookback
        samples = self.ttft if kind == "ttft" else self.tpot
        p = percentile([v for t, v in samples if t >= edge], 0.95)
        return None if p is None else p * 1000.0

    def count(self, kind: str, lookback: float) -> int:
        edge = self.clock() - lookback
        samples = {"arrivals": self.arrivals, "completions": self.completions}[kind]
        return sum(1 for t in samples if t >= edge)


def completion_tokens(body: bytes) -> int:
    """``usage``'s output tokens of a whole answer (OpenAI's or Anthropic's); 0 when absent."""
    try:
        usage = json.loads(body).get("usage") or {}
        return int(usage.get("completion_tokens") or usage.get("output_tokens") or 0)
    except (ValueError, AttributeError, TypeError):
        return 0
