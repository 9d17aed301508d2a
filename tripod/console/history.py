"""Benchmark history: the same settings measured across dated runs, and a flag on a run that is
slower than the previous one beyond the noise of both.

Noise (what "beyond its noise" means). Each level of a ``tripod bench`` run records its own spread
(``noise`` in results.json, from ``bench/metrics.py``): the relative standard error of its central
values, estimated from the per-request sample —

- throughput: sd / mean / √n of the per-request decode rates ((output tokens − 1) / (E2E − TTFT));
  a closed loop's output tok/s is about concurrency × the mean decode rate, so it moves with it;
- TTFT: sd / mean / √n of the per-request TTFTs.

A results.json written before bench recorded its noise gets an estimate from its percentiles
(a normal's p90 − p50 = 1.28 sd, of TPOT and of TTFT, over √completed); with neither,
``DEFAULT_NOISE``. Each run's noise is at least ``NOISE_FLOOR``: two runs on a shared machine differ
by more than their sampling error alone, and identical fixed-length requests can have almost none.

The flag. With ``a`` and ``b`` the relative noises of the previous and the current run, the
current one is *slower* when its tok/s fell by more than ``Z · √(a² + b²)`` (relative to the
previous), and its *TTFT is worse* when its TTFT p50 rose by more than the same for TTFT. ``Z = 2``:
a 1-in-40 false alarm for a one-sided drop if the noises are right.
"""

from __future__ import annotations

import math

from tripod.console.models import BenchLevel, BenchRun, HistoryPoint, HistorySeries, SettingsKey

Z = 2.0
NOISE_FLOOR = 0.02
DEFAULT_NOISE = 0.05
_P90_SD = 1.2816  # a normal's p90 − p50, in standard deviations


def _noise(measured: float | None) -> tuple[float, bool]:
    if measured is None or not math.isfinite(measured) or measured < 0:
        return DEFAULT_NOISE, False
    return max(NOISE_FLOOR, measured), True


def key_of(run: BenchRun, level: BenchLevel) -> SettingsKey:
    return SettingsKey(target=level.target, dataset=level.dataset, mode=level.mode, concurrency=level.concurrency,
                       request_rate=level.request_rate, isl=run.isl, osl=run.osl, model=run.model)


def build_history(runs: list[BenchRun]) -> list[HistorySeries]:
    """One series per settings key, its points in date order, each compared with the one before.
    Levels with nothing completed are left out (they have no speed to compare)."""
    by_key: dict[str, tuple[SettingsKey, list[HistoryPoint]]] = {}
    for run in sorted(runs, key=lambda r: (r.started, r.id)):
        seen_here: set[str] = set()
        for level in run.levels:
            if level.completed <= 0 or not math.isfinite(level.output_throughput):
                continue
            key = key_of(run, level)
            k = key.model_dump_json()
            if k in seen_here:  # the same settings twice in one run: the first stands for it
                continue
            seen_here.add(k)
            tput_noise, measured = _noise(level.output_throughput_rel_noise)
            ttft_noise, _ = _noise(level.ttft_rel_noise)
            point = HistoryPoint(run=run.id, started=run.started, output_throughput=level.output_throughput,
                                 ttft_p50_ms=level.ttft_p50_ms, throughput_noise=tput_noise, ttft_noise=ttft_noise,
                                 noise_measured=measured)
            series = by_key.setdefault(k, (key, []))[1]
            if series:
                compare(series[-1], point)
            series.append(point)
    out = [HistorySeries(key=key, label=key.label(), points=points) for key, points in by_key.values()]
    return sorted(out, key=lambda s: s.label)


def compare(prev: HistoryPoint, cur: HistoryPoint) -> None:
    """Fill ``cur``'s change, threshold and flags against ``prev`` (see the module docstring)."""
    cur.previous = prev.run
    if prev.output_throughput > 0:
        cur.change = cur.output_throughput / prev.output_throughput - 1.0
        cur.threshold = Z * math.hypot(prev.throughput_noise, cur.throughput_noise)
        cur.slower = cur.change < -cur.threshold
    if prev.ttft_p50_ms and cur.ttft_p50_ms is not None:
        cur.ttft_change = cur.ttft_p50_ms / prev.ttft_p50_ms - 1.0
        cur.ttft_worse = cur.ttft_change > Z * math.hypot(prev.ttft_noise, cur.ttft_noise)


def noise_from_percentiles(p50: float | None, p90: float | None, n: int) -> float | None:
    """A level's relative noise estimated from two percentiles of its per-request values (for
    results.json files written before bench recorded its noise)."""
    if p50 is None or p90 is None or n < 2 or not (math.isfinite(p50) and math.isfinite(p90)) or p50 <= 0:
        return None
    return (max(p90 - p50, 0.0) / _P90_SD) / p50 / math.sqrt(n)
