"""What the router tells its console (``tripod.console``): every replica as the router sees it (state,
circuit, load, routing counts) plus the supervisor's view (slots down and waiting for a relaunch,
the autoscaler, scale events), and each replica's own metrics, read from its ``/metrics``."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from typing import Any, Literal, Protocol

import httpx
from prometheus_client.metrics_core import Metric

from tripod.console.models import AutoscalerView, FleetEvent, FleetView, NodeView
from tripod.console.readings import Reading, read_text
from tripod.protocol import health
from tripod.router.replica import Replica
from tripod.router.router import Router


class SupervisorView(Protocol):
    """What the console reads of a fleet's supervisor (``tripod.fleet.supervisor.Supervisor``); the
    router names it by this protocol so that it never imports the fleet above it."""

    config: Any
    active: Any
    autoscaler: Any
    scale_events: list[dict[str, Any]]

    def down(self) -> list[tuple[str, int, float | None]]: ...


class RouterConsoleSource:
    """A ``ConsoleSource`` over a router (and its supervisor, for a fleet this process launched)."""

    kind: Literal["server", "fleet"] = "fleet"

    def __init__(self, router: Router, supervisor: SupervisorView | None = None) -> None:
        self.router = router
        self.supervisor = supervisor
        self._last: dict[str, Reading] = {}  # by replica name: the latest reading, for the node view
        self._model: str | None = None

    def model(self) -> str | None:
        return self._model

    def _node(self, rep: Replica) -> NodeView:
        r = self._last.get(rep.name) if rep.breaker.closed else None
        c = rep.counters
        return NodeView(
            name=rep.name, url=rep.url, state=rep.state(), pid=rep.process.pid if rep.process is not None else None,
            inflight=rep.inflight, inflight_tokens=round(rep.inflight_tokens, 1), running=rep.running,
            waiting=rep.waiting, routed=rep.routed, failures=rep.failures, restarts=rep.restarts,
            cached_share=r.cache_hits / r.cache_queries if r is not None and r.cache_queries > 0 else None,
            estimated_cached_share=rep.est_cached_tokens / rep.est_prompt_tokens if rep.est_prompt_tokens else None,
            circuit="closed" if rep.breaker.closed else "open", consecutive_failures=rep.breaker.failures,
            kv_usage=r.kv_usage if r is not None else None, role=rep.role,
            tier_hits_pool=c.get("tier_hits/pool"), tier_hits_disk=c.get("tier_hits/disk"),
            kv_sent_bytes=c.get("pd_kv_sent_bytes"), kv_received_bytes=c.get("pd_kv_received_bytes"),
            kv_transfer_s=(c.get("pd_kv_send_seconds_sum") or c.get("pd_kv_receive_seconds_sum")),
        )

    async def fleet(self) -> FleetView:
        router, sup = self.router, self.supervisor
        nodes = [self._node(rep) for rep in router.replicas.values()]
        autoscaler = None
        events: list[FleetEvent] = []
        if sup is not None:
            have = {n.name for n in nodes}
            nodes += [NodeView(name=name, state="down", restarts=restarts, restart_in_s=None if at is None else round(at, 1))
                      for name, restarts, at in sup.down() if name not in have]
            cfg = sup.config
            autoscaler = AutoscalerView(min_replicas=cfg.min_replicas, max_replicas=cfg.max_replicas,
                                        active=len(sup.active), desired=sup.autoscaler.desired(),
                                        target_inflight=cfg.target_inflight)
            events = [FleetEvent(t=e["wall"], kind="scale", text=f"scale {e['from']} → {e['to']} replicas"
                                 + (f": {e['reason']}" if e.get("reason") else ""))
                      for e in sup.scale_events if "wall" in e]
        nodes.sort(key=lambda n: (len(n.name), n.name))
        return FleetView(kind="fleet", t=time.time(), policy=router.policy.name, pending=router.pending,
                         queue_depth=router.queue_depth, nodes=nodes, autoscaler=autoscaler, events=events,
                         pd={k: v for k, v in router.pd.totals.items()} if router.pd.prefill_replicas() else None)

    async def _read(self, client: httpx.AsyncClient, rep: Replica) -> tuple[Replica, Reading | None]:
        try:
            r = await client.get(rep.url + "/metrics")
        except httpx.HTTPError:
            return rep, None
        return rep, read_text(r.text) if r.status_code == 200 else None

    def tenant_families(self) -> Iterable[Metric]:
        """The router's per-tenant series (``tripod:router_tenant_*``): every request of the fleet
        passes it (the replicas' own are each a share)."""
        return self.router.metrics.registry.collect()

    async def readings(self) -> dict[str, Reading]:
        client = self.router.probe_client
        if client is None:  # the router has not started
            return {}
        reps = [rep for rep in self.router.replicas.values() if rep.breaker.closed or rep.draining]
        got = await asyncio.gather(*(self._read(client, rep) for rep in reps))
        self._last = {rep.name: reading for rep, reading in got if reading is not None}
        if self._model is None and reps:
            await self._learn_model(client, reps[0])
        # NOTE: keyed by URL: a replica relaunched in the same slot is a new process on a new port,
        # whose counters start from zero (never a negative rate).
        return {rep.url: reading for rep, reading in got if reading is not None}

    async def _learn_model(self, client: httpx.AsyncClient, rep: Replica) -> None:
        try:
            r = await client.get(rep.url + "/health")
        except httpx.HTTPError:
            return
        self._model = health.probe(r.content).model if r.status_code == 200 else None
