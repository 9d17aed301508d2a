"""Prometheus metrics of the router (``tripod:router_*``): answers, routing decisions and their
reasons, retries, per-replica load and health, and estimated prefix-cache hit rates."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tripod.router.replica import Replica
from tripod.tenants.metrics import TenantMetrics


class RouterMetrics:
    """Owns one registry. Counters move as requests flow; per-replica gauges are refreshed from the
    replica set on every scrape (``render``), and a removed replica's series are dropped."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.http_requests = Counter("tripod:router_http_requests", "router answers by route and status",
                                     ["route", "status"], registry=r)
        self.routed = Counter("tripod:router_routed", "routing decisions by replica and reason",
                              ["replica", "reason"], registry=r)
        self.retries = Counter("tripod:router_retries", "requests retried on another replica, by the failure",
                               ["replica", "cause"], registry=r)
        self.stream_failures = Counter("tripod:router_stream_failures",
                                       "streams cut by a replica failure after the first token", ["replica"],
                                       registry=r)
        self.continuations = Counter(
            "tripod:router_continuations",
            "answers continued on another replica after the one serving them failed mid-answer, by outcome: "
            "ok (the continuation took over), failed (that attempt could not start; another may follow), "
            "exhausted (no continuation left: the client got an error)", ["outcome"], registry=r)
        self.continuation_seconds = Histogram(
            "tripod:router_continuation_seconds",
            "streams: from a replica's failure mid-answer to the first byte of the continued answer",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64), registry=r)
        self.est_prompt = Counter("tripod:router_estimated_prompt_tokens", "prompt tokens routed (estimated)",
                                  ["replica"], registry=r)
        self.est_cached = Counter("tripod:router_estimated_cached_tokens",
                                  "prompt tokens routed to where they were probably cached (estimated)",
                                  ["replica"], registry=r)
        self.queue_depth = Gauge("tripod:router_queue_depth", "requests waiting for a routable replica", registry=r)
        self.pending = Gauge("tripod:router_pending_requests", "requests in the router (waiting + in flight)",
                             registry=r)
        g = "replica"
        self.inflight = Gauge("tripod:router_replica_inflight", "requests in flight to the replica", [g], registry=r)
        self.inflight_tokens = Gauge("tripod:router_replica_inflight_tokens",
                                     "estimated tokens of the requests in flight to the replica", [g], registry=r)
        self.running = Gauge("tripod:router_replica_running", "sequences running (replica's /metrics)", [g], registry=r)
        self.waiting = Gauge("tripod:router_replica_waiting", "sequences waiting (replica's /metrics)", [g], registry=r)
        self.healthy = Gauge("tripod:router_replica_healthy", "1 while the replica is routable", [g], registry=r)
        self.hit_rate = Gauge("tripod:router_replica_estimated_hit_rate",
                              "estimated share of routed prompt tokens found cached", [g], registry=r)
        self._gauges = (self.inflight, self.inflight_tokens, self.running, self.waiting, self.healthy, self.hit_rate)
        self._known: set[str] = set()
        # Per tenant (tripod.tenants): requests by status, rejections by limit, time to the answer's
        # first byte; tokens of whole answers (the replicas count every token and its TPOT).
        self.tenants = TenantMetrics(r, "tripod:router_tenant_")

    def render(self, replicas: Iterable[Replica], queue_depth: int, pending: int) -> bytes:
        self.queue_depth.set(queue_depth)
        self.pending.set(pending)
        seen = set()
        for rep in replicas:
            seen.add(rep.name)
            self.inflight.labels(rep.name).set(rep.inflight)
            self.inflight_tokens.labels(rep.name).set(rep.inflight_tokens)
            self.running.labels(rep.name).set(rep.running)
            self.waiting.labels(rep.name).set(rep.waiting)
            self.healthy.labels(rep.name).set(1 if rep.routable else 0)
            self.hit_rate.labels(rep.name).set(rep.est_cached_tokens / rep.est_prompt_tokens if rep.est_prompt_tokens else 0)
        for gone in self._known - seen:
            for gauge in self._gauges:
                try:
                    gauge.remove(gone)
                except KeyError:
                    pass
        self._known = seen
        return generate_latest(self.registry)
