"""Benchmark metrics from recorded request timings. Pure functions; every formula is here.

Per request (times in seconds, measured by the client on the stream):
- TTFT = first content chunk − request sent
- E2E  = last chunk − request sent
- ITL  = the gaps between consecutive content chunks
- TPOT = (E2E − TTFT) / (output tokens − 1)          (requests with ≥ 2 output tokens)

Per run (``duration`` = first request sent → last request finished, warm-up excluded):
- request throughput = completed / duration
- input / output / total token throughput = tokens / duration
- interactivity = 1 / median TPOT  (tokens per second one user sees)
- goodput = completed requests meeting every SLO (TTFT ≤ ttft, TPOT ≤ tpot) / duration
- cached token share = Σ cached prompt tokens / Σ prompt tokens  (from usage)
- per session (agentic): E2E summed over its turns / output tokens of its turns; p90 over sessions
- cost per million output tokens = cost per machine-hour × machines / (output tok/s × 3600) × 10⁶
  (with ``--cost-per-hour``)
- noise (the level's own spread, for comparing runs): relative standard error of the mean,
  sd / mean / √n, of the per-request decode rates ((output tokens − 1) / (E2E − TTFT)) and of
  the per-request TTFTs
Distributions are summarized as mean and p50/p90/p95/p99 (linear interpolation between ranks).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

PERCENTILES = (50, 90, 95, 99)


@dataclass(slots=True)
class RequestResult:
    """One request as the client saw it."""

    start: float
    ttft: float | None = None  # seconds; None if no content arrived
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None  # kind: "http_429", "http_500", "timeout", "connection", "stream_error", ...
    session: str | None = None
    turn: int = 0  # agentic sessions: the turn's index in its session
    output_ids: list[int] = field(default_factory=list)  # the answer's token ids, where the server sends them

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot(self) -> float | None:
        if self.e2e is None or self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def percentile(values: list[float], p: float) -> float:
    """The p-th percentile with linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return math.nan
    xs = sorted(values)
    rank = (len(xs) - 1) * p / 100.0
    lo = math.floor(rank)
    hi = math.ceil(rank)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


def summary_ms(values_s: list[float]) -> dict[str, float]:
    """mean and p50/p90/p95/p99 of values in seconds, reported in milliseconds."""
    ms = [v * 1000.0 for v in values_s]
    out = {"mean": sum(ms) / len(ms) if ms else math.nan}
    for p in PERCENTILES:
        out[f"p{p}"] = percentile(ms, p)
    return out


def relative_noise(values: list[float]) -> float | None:
    """sd / mean / √n: the relative standard error of the mean of ``values`` (None below 2 values
    or for a mean ≤ 0)."""
    n = len(values)
    if n < 2:
        return None
    mean = sum(values) / n
    if mean <= 0:
        return None
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    return sd / mean / math.sqrt(n)


def cost_per_million(cost_per_hour: float | None, machines: int, output_throughput: float) -> float | None:
    """USD per million output tokens at ``output_throughput`` tok/s on ``machines`` machines that cost
    ``cost_per_hour`` each; None without a price or without output."""
    if cost_per_hour is None or output_throughput <= 0:
        return None
    return cost_per_hour * max(machines, 1) / (output_throughput * 3600.0) * 1e6


def meets_slo(r: RequestResult, slo_ttft: float | None, slo_tpot: float | None) -> bool:
    """Whether ``r`` met both SLOs (in seconds; None: no limit) — what goodput counts."""
    if slo_ttft is not None and (r.ttft is None or r.ttft > slo_ttft):
        return False
    t = r.tpot
    return not (slo_tpot is not None and t is not None and t > slo_tpot)


def session_p90_ms_per_token(ok: list[RequestResult]) -> float | None:
    """p90 over sessions of (the session's end-to-end time / its output tokens), in ms; None without sessions."""
    sessions: dict[str, list[RequestResult]] = {}
    for r in ok:
        if r.session is not None:
            sessions.setdefault(r.session, []).append(r)
    per_session = [
        sum(x.e2e or 0.0 for x in turns) / toks
        for turns in sessions.values()
        if (toks := sum(x.output_tokens for x in turns)) > 0
    ]
    return percentile([v * 1000 for v in per_session], 90) if per_session else None


def _noise(ok: list[RequestResult]) -> dict[str, Any]:
    return {
        "output_throughput": relative_noise(
            [(r.output_tokens - 1) / (r.e2e - r.ttft) for r in ok
             if r.output_tokens >= 2 and r.e2e is not None and r.ttft is not None and r.e2e > r.ttft]),
        "ttft": relative_noise([r.ttft for r in ok if r.ttft is not None]),
        "n": len(ok),
    }


def summarize(
    results: list[RequestResult],
    duration: float,
    *,
    slo_ttft: float | None = None,
    slo_tpot: float | None = None,
    machines: int = 1,
    cost_per_hour: float | None = None,
) -> dict[str, Any]:
    """The run's metrics (see the module docstring for every formula)."""
    ok = [r for r in results if r.ok]
    tpots = [t for r in ok if (t := r.tpot) is not None]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    dur = max(duration, 1e-9)
    tpot_p50 = percentile(tpots, 50)
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": dict(Counter(r.error for r in results if r.error)),
        "duration_s": duration,
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "ttft_ms": summary_ms([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": summary_ms(tpots),
        "itl_ms": summary_ms([g for r in ok for g in r.itl]),
        "e2e_ms": summary_ms([r.e2e for r in ok if r.e2e is not None]),
        "request_throughput": len(ok) / dur,
        "input_throughput": in_tokens / dur,
        "output_throughput": out_tokens / dur,
        "output_throughput_per_machine": out_tokens / dur / max(machines, 1),
        "total_throughput": (in_tokens + out_tokens) / dur,
        "interactivity": 1.0 / tpot_p50 if tpots and tpot_p50 > 0 else math.nan,
        "goodput": sum(1 for r in ok if meets_slo(r, slo_ttft, slo_tpot)) / dur,
        "cached_token_share": sum(r.cached_tokens for r in ok) / in_tokens if in_tokens else 0.0,
        "session_p90_ms_per_token": session_p90_ms_per_token(ok),
        "cost_per_million_output_tokens": cost_per_million(cost_per_hour, machines, out_tokens / dur),
        "noise": _noise(ok),
    }
