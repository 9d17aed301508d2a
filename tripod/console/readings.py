"""What the console reads from one Prometheus page: a ``Reading`` of cumulative counters, histogram
buckets and gauges, under tripod's metric names (``tripod:``; vLLM's ``vllm:`` names too where they
are the same, so a console in front of vLLM replicas draws what it can).

Pure functions: the page comes in as text or as parsed families, a ``Reading`` comes out; deltas
between two readings of one process (with counter resets handled) and histogram quantiles are
here too.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

_PREFIXES = ("tripod:", "vllm:")
_JF = "jump_forward"


@dataclass(slots=True)
class Reading:
    """Cumulative values of one process at one moment (counters and buckets only grow, except
    when the process restarts), and its gauges."""

    generation_tokens: float = 0.0
    prompt_tokens: float = 0.0
    requests: float = 0.0  # finished sequences
    cache_hits: float = 0.0
    cache_queries: float = 0.0
    jf_proposed: float = 0.0
    jf_accepted: float = 0.0
    spec_draft: float = 0.0  # speculative draft tokens (proposers other than jump-forward)
    spec_accepted: float = 0.0
    ttft_buckets: dict[float, float] = field(default_factory=dict)  # upper bound → cumulative count
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float | None = None


_COUNTERS = {
    "generation_tokens": "generation_tokens",
    "prompt_tokens": "prompt_tokens",
    "request_success": "requests",
    "prefix_cache_hits": "cache_hits",
    "prefix_cache_queries": "cache_queries",
    "jump_forward_proposed_tokens": "jf_proposed",
    "jump_forward_accepted_tokens": "jf_accepted",
}
_GAUGES = {"num_requests_running": "running", "num_requests_waiting": "waiting"}


def _bare(name: str) -> str | None:
    for p in _PREFIXES:
        if name.startswith(p):
            return name[len(p):]
    return None


def read_families(families: Iterable[Metric]) -> Reading:
    """A ``Reading`` from parsed metric families (``registry.collect()`` or a parsed page)."""
    r = Reading()
    for fam in families:
        name = _bare(fam.name)
        if name is None:
            continue
        for s in fam.samples:
            sname = _bare(s.name) or ""
            if sname.endswith("_created"):
                continue
            value = float(s.value)
            if math.isnan(value):
                continue
            if name in _COUNTERS and sname.endswith("_total"):
                attr = _COUNTERS[name]
                setattr(r, attr, getattr(r, attr) + value)
            elif name in _GAUGES:
                attr = _GAUGES[name]
                setattr(r, attr, getattr(r, attr) + value)
            elif name == "kv_cache_usage_perc":
                r.kv_usage = max(r.kv_usage or 0.0, value)
            elif name == "time_to_first_token_seconds" and sname.endswith("_bucket"):
                le = float(s.labels.get("le", "inf"))
                r.ttft_buckets[le] = r.ttft_buckets.get(le, 0.0) + value
            elif name.startswith("spec_decode_num_") and sname.endswith("_total"):
                if s.labels.get("proposer") == _JF:
                    continue  # counted by the jump-forward counters
                if name == "spec_decode_num_draft_tokens":
                    r.spec_draft += value
                elif name == "spec_decode_num_accepted_tokens":
                    r.spec_accepted += value
    return r


def read_text(text: str) -> Reading | None:
    """A ``Reading`` from a Prometheus text page; None when the page does not parse."""
    try:
        return read_families(text_string_to_metric_families(text))
    except ValueError:
        return None


_CUMULATIVE = ("generation_tokens", "prompt_tokens", "requests", "cache_hits", "cache_queries", "jf_proposed",
               "jf_accepted", "spec_draft", "spec_accepted")


@dataclass(slots=True)
class ReadingDelta:
    """What happened between two readings (summed over processes when they are merged)."""

    generation_tokens: float = 0.0
    prompt_tokens: float = 0.0
    requests: float = 0.0
    cache_hits: float = 0.0
    cache_queries: float = 0.0
    jf_proposed: float = 0.0
    jf_accepted: float = 0.0
    spec_draft: float = 0.0
    spec_accepted: float = 0.0
    ttft_buckets: dict[float, float] = field(default_factory=dict)

    def add(self, other: ReadingDelta) -> None:
        for name in _CUMULATIVE:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for le, n in other.ttft_buckets.items():
            self.ttft_buckets[le] = self.ttft_buckets.get(le, 0.0) + n


def delta(before: Reading | None, after: Reading) -> ReadingDelta:
    """``after − before`` for one process. A counter that went down means the process restarted
    between the readings: everything it counted since is new (its value). No ``before``: nothing
    is known to be new (the process was just found; its totals are history, not this interval)."""
    d = ReadingDelta()
    if before is None:
        return d
    reset = any(getattr(after, name) < getattr(before, name) for name in _CUMULATIVE) or any(
        after.ttft_buckets.get(le, 0.0) < count for le, count in before.ttft_buckets.items())
    for name in _CUMULATIVE:
        a = getattr(after, name)
        setattr(d, name, a if reset else a - getattr(before, name))
    for le, count in after.ttft_buckets.items():
        d.ttft_buckets[le] = count if reset else count - before.ttft_buckets.get(le, 0.0)
    return d


def histogram_quantile(q: float, buckets: dict[float, float]) -> float | None:
    """The q-quantile of a cumulative histogram (upper bound → count), interpolated linearly within
    the bucket it falls in, as Prometheus' ``histogram_quantile`` does; None for an empty one.
    A quantile in the ``+Inf`` bucket is the largest finite bound."""
    if not buckets:
        return None
    bounds = sorted(buckets)
    total = buckets[bounds[-1]]
    if total <= 0:
        return None
    rank = q * total
    prev_bound, prev_count = 0.0, 0.0
    for b in bounds:
        count = buckets[b]
        if count >= rank:
            if math.isinf(b):
                return prev_bound
            if count == prev_count:
                return b
            return prev_bound + (b - prev_bound) * (rank - prev_count) / (count - prev_count)
        prev_bound, prev_count = b, count
    return prev_bound
