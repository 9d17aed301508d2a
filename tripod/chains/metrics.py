"""Per-chainlet metrics (Prometheus), and merging the pages of many processes into one.

Each process of a chain counts what it sees: a chainlet's replica counts the calls it serves
(``tripod:chainlet_calls_total{chainlet, outcome}``, latency, in flight, streamed items); a caller
counts its calls to each dependency (``tripod:chainlet_dependency_*{caller, chainlet}``: attempts'
outcomes, latency as the caller sees it, retries by cause, failures past retries by code). The
server of a chain scrapes every replica and serves the merge on its own ``/metrics``, each sample
labelled with the ``replica`` it came from. ``run_local`` keeps one ``ChainMetrics`` for the chain.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tripod.router.merge import merge_pages

__all__ = ["ChainMetrics", "merge_pages"]

LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                   60.0, 120.0, 300.0)


class ChainMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.calls = Counter("tripod:chainlet_calls", "calls a chainlet served, by outcome (ok, error, invalid, "
                             "cancelled)", ["chainlet", "outcome"], registry=r)
        self.latency = Histogram("tripod:chainlet_latency_seconds", "time a chainlet took to answer a call (to its "
                                 "last item, when it streams)", ["chainlet"], buckets=LATENCY_BUCKETS, registry=r)
        self.inflight = Gauge("tripod:chainlet_inflight", "calls a chainlet is serving", ["chainlet"], registry=r)
        self.items = Counter("tripod:chainlet_stream_items", "items a streaming chainlet sent", ["chainlet"],
                             registry=r)
        self.dep_calls = Counter("tripod:chainlet_dependency_calls", "attempts of calls to a dependency, by "
                                 "outcome", ["caller", "chainlet", "outcome"], registry=r)
        self.dep_latency = Histogram("tripod:chainlet_dependency_latency_seconds", "a call to a dependency as "
                                     "its caller sees it (all attempts)", ["caller", "chainlet"],
                                     buckets=LATENCY_BUCKETS, registry=r)
        self.retries = Counter("tripod:chainlet_retries", "calls to a dependency tried again, by the failure",
                               ["caller", "chainlet", "cause"], registry=r)
        self.failures = Counter("tripod:chainlet_failures", "calls to a dependency that failed for good (after "
                                "retries), by code", ["caller", "chainlet", "code"], registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def value(self, name: str, **labels: str) -> float:
        """The current value of one sample (0 when it was never set), e.g.
        ``value("tripod:chainlet_retries_total", chainlet="Critic", cause="timeout")``; labels not
        given are summed over."""
        total = 0.0
        for family in self.registry.collect():
            for s in family.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    total += s.value
        return total
