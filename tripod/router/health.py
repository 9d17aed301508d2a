"""Health and load: each replica's ``/health`` probed and its ``/metrics`` scraped on timers.

A probe's verdict goes to the router's circuit accounting (``succeeded``/``failed``): a replica
that cannot be reached, or answers anything but 200, leaves rotation. A scrape reads the
replica's own running and waiting counts (tripod's, vLLM's or SGLang's metric names), which the
policies count as load the router did not send.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import httpx

from tripod.config import RouterConfig
from tripod.protocol import health
from tripod.router.replica import Replica

_LOAD_NAMES = {
    "running": ("tripod:num_requests_running", "vllm:num_requests_running", "sglang:num_running_reqs"),
    "waiting": ("tripod:num_requests_waiting", "vllm:num_requests_waiting", "sglang:num_queue_reqs"),
}


# Counters shown per replica (/fleet, the console): cache tiers and prefill/decode KV transfers.
_COUNTERS = ("tripod:prefix_cache_tier_hits_total", "tripod:pd_kv_sent_blocks_total", "tripod:pd_kv_sent_bytes_total",
             "tripod:pd_kv_received_blocks_total", "tripod:pd_kv_received_bytes_total", "tripod:pd_prefills_total",
             "tripod:pd_kv_receives_total", "tripod:pd_prefill_seconds_sum", "tripod:pd_prefill_seconds_count",
             "tripod:pd_kv_send_seconds_sum", "tripod:pd_kv_receive_seconds_sum", "tripod:pd_kv_receive_seconds_count")


def parse_counters(text: str) -> dict[str, float]:
    """The cache-tier and KV-transfer counters of a tripod page, by name (without ``tripod:`` and
    ``_total``) and, where the series has one, its ``tier`` or ``outcome`` label (``tier_hits/disk``)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("tripod:"):
            continue
        name, _, rest = line.partition("{")
        if name not in _COUNTERS:
            continue
        key = name.removeprefix("tripod:").removesuffix("_total").replace("prefix_cache_tier_hits", "tier_hits")
        for label in ("tier", "outcome"):
            at = rest.find(f'{label}="')
            if at >= 0:
                key += "/" + rest[at + len(label) + 2 :].split('"', 1)[0]
        try:
            out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            pass
    return out


def parse_load(text: str) -> tuple[int, int]:
    """Running and waiting sequences from a Prometheus text page (tripod's, vLLM's or SGLang's names)."""
    found = {"running": 0.0, "waiting": 0.0}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        for key, names in _LOAD_NAMES.items():
            if name in names:
                try:
                    found[key] += float(line.rsplit(" ", 1)[1])
                except (IndexError, ValueError):
                    pass
    return int(found["running"]), int(found["waiting"])


class HealthChecker:
    """Owns the probe client and the two timers. ``replicas`` lists the replicas to check now;
    ``succeeded(rep)`` and ``failed(rep, why, fatal)`` are the router's circuit accounting."""

    def __init__(self, config: RouterConfig, replicas: Callable[[], list[Replica]],
                 succeeded: Callable[[Replica], None], failed: Callable[[Replica, str, bool], None]) -> None:
        self.config = config
        self.replicas = replicas
        self.succeeded = succeeded
        self.failed = failed
        self.client: httpx.AsyncClient | None = None
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        """Open the client, start the timers, and probe every replica once now."""
        cfg = self.config
        self.client = httpx.AsyncClient(timeout=cfg.health_timeout)
        self._tasks = [asyncio.create_task(self._every(cfg.health_interval, self.probe)),
                       asyncio.create_task(self._every(cfg.metrics_interval, self.scrape))]
        await self.probe_all()

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.client is not None:
            await self.client.aclose()

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(r) for r in self.replicas()))

    async def _every(self, interval: float, fn: Callable[[Replica], Awaitable[None]]) -> None:
        while True:
            await asyncio.sleep(interval)
            await asyncio.gather(*(fn(r) for r in self.replicas()), return_exceptions=True)

    async def probe(self, rep: Replica) -> None:
        """One ``/health`` probe: 200 counts as a success (and says whether the replica continues
        answers); anything else, or no answer, as a failure."""
        assert self.client is not None
        try:
            r = await self.client.get(rep.url + "/health")
        except httpx.ConnectError as e:
            self.failed(rep, f"health probe: cannot connect ({e})", True)
            return
        except httpx.HTTPError as e:
            self.failed(rep, f"health probe: {type(e).__name__}", False)
            return
        if r.status_code == 200:
            p = health.probe(r.content)
            rep.continues, rep.role, rep.kv_tier = p.continuation, p.role, p.kv_tier
            self.succeeded(rep)
        else:
            # NOTE: a replica that answers 503 (draining, engine dead) asks to get nothing more.
            self.failed(rep, f"health probe answered {r.status_code}", True)

    async def scrape(self, rep: Replica) -> None:
        """Read a routable replica's running and waiting counts from its ``/metrics``."""
        if not rep.breaker.closed:
            return
        assert self.client is not None
        before = rep.inflight
        try:
            r = await self.client.get(rep.url + "/metrics")
        except httpx.HTTPError:
            return
        if r.status_code == 200:
            running, waiting = parse_load(r.text)
            rep.running, rep.waiting = running, waiting
            rep.counters = parse_counters(r.text)
            # NOTE: against the larger of the in-flight counts before and after the read: a request
            # of this router's that finished while /metrics was read is in the replica's counts but
            # no longer in rep.inflight, and must not stay counted as another router's until the
            # next scrape; later finishes are seen by the router at once.
            rep.external = max(0, running + waiting - max(before, rep.inflight))
