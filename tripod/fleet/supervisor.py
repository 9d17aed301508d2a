"""The replica supervisor: launches replicas, restarts the ones that die, scales the fleet.

Each replica has a slot (``replica-<i>``). A slot whose process exits unasked is relaunched after
a backoff that doubles per crash (reset once the replica has been healthy a while); the new process
joins the router unroutable and becomes routable on its first good health probe. Scale-down drains:
the replica stops receiving requests, its in-flight requests finish (up to ``drain_timeout``), then
it gets SIGTERM, which makes the server itself drain before exiting — no request is lost.

The autoscaler is ``fleet/slo.py``'s when an SLO is set, else ``fleet/autoscaler.py``'s (requests
in flight); each decision is recorded with its reason (``/fleet``'s ``scale_events``). With
``--min-replicas 0`` an idle fleet drains to zero replicas; a request then waits in the router
(held, not refused) while the autoscaler starts one, and that cold start is measured: the replica's
time to healthy, and the held request's TTFT (the router's ``latency.held``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client import Gauge

from tripod.config import FleetConfig
from tripod.fleet.autoscaler import Autoscaler
from tripod.fleet.replicas import ReplicaLauncher, ReplicaProcess
from tripod.fleet.slo import FleetSignals, SloAutoscaler
from tripod.router.router import Router

log = logging.getLogger("tripod.fleet")

_WATCH_INTERVAL = 0.5
_STABLE_AFTER = 30.0  # healthy this long: the next crash starts the backoff over


@dataclass(slots=True)
class _Slot:
    index: int
    process: ReplicaProcess | None = None
    restarts: int = 0
    backoff: float = 0.0
    restart_at: float | None = None
    stopping: bool = False
    launching: bool = False
    startup_failures: int = 0
    cold: bool = False  # launched while no replica was routable: its start-up is a cold start
    healthy_seen: bool = False

    @property
    def name(self) -> str:
        return f"replica-{self.index}"


class Supervisor:
    """Owns the replica slots and their processes; keeps the router's replica set in step with them."""

    def __init__(self, router: Router, launcher: ReplicaLauncher, config: FleetConfig,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.router = router
        self.launcher = launcher
        self.config = config
        self.clock = clock
        self.autoscaler: Autoscaler | SloAutoscaler = SloAutoscaler(config) if config.slo else Autoscaler(config)
        router.latency.horizon = max(router.latency.horizon, config.lookback)  # the look-back stays measurable
        self.cold_starts: list[dict[str, Any]] = []
        self.cold_start_gauge = Gauge("tripod:fleet_cold_start_seconds",
                                      "the last cold start: launch to healthy of a replica started with none routable",
                                      registry=router.metrics.registry)
        self.slots: dict[int, _Slot] = {}
        self.scale_events: list[dict[str, Any]] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._drains: set[asyncio.Task[None]] = set()
        self._closing = False
        self.ever_healthy = False
        self.fatal: str | None = None  # set when replicas cannot start at all (exit 2 before any was healthy)

    # ------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        await asyncio.gather(*(self._launch(self._new_slot()) for _ in range(self.config.min_replicas)))
        self._tasks.append(asyncio.create_task(self._watch()))
        if self.config.autoscaling:
            self._tasks.append(asyncio.create_task(self._autoscale()))

    async def wait_routable(self, timeout: float, replicas: int = 1) -> bool:
        """Wait (up to ``timeout`` s) until ``replicas`` replicas answer requests; False past the
        timeout or once replicas cannot start at all (``fatal``)."""
        await self.router.wait_until(lambda: len(self.router.serving()) >= replicas or self.fatal is not None,
                                     timeout)
        return len(self.router.serving()) >= replicas

    async def stop(self) -> None:
        """Every replica drains and exits (SIGTERM; SIGKILL past the drain timeout)."""
        self._closing = True
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, *self._drains, return_exceptions=True)
        procs = [s.process for s in self.slots.values() if s.process is not None]
        await asyncio.gather(*(asyncio.to_thread(p.terminate) for p in procs))
        codes = await asyncio.gather(*(asyncio.to_thread(p.wait, self.config.drain_timeout) for p in procs))
        for p, code in zip(procs, codes, strict=True):
            if code is None:
                log.warning("%s did not exit in %.0f s; killing it", p.name, self.config.drain_timeout)
                await asyncio.to_thread(p.kill)
        await asyncio.to_thread(self.launcher.close)

    # ------------------------------------------------------------ slots
    def _new_slot(self) -> _Slot:
        index = next(i for i in range(len(self.slots) + 1) if i not in self.slots)
        slot = self.slots[index] = _Slot(index)
        return slot

    async def _launch(self, slot: _Slot) -> None:
        slot.launching = True
        try:
            if self.launcher.blocking:
                proc = await asyncio.to_thread(self.launcher.launch, slot.index)
            else:
                proc = self.launcher.launch(slot.index)
        except Exception as e:  # a launcher failure is a crash like any other: back off, retry
            log.error("%s could not be launched: %s", slot.name, e)
            self._schedule_restart(slot)
            return
        finally:
            slot.launching = False
        if slot.stopping or self._closing:
            await asyncio.to_thread(proc.terminate)
            return
        slot.process = proc
        slot.restart_at = None
        slot.cold, slot.healthy_seen = not self.router.routable(), False
        region = self.router.config.region
        labels = getattr(proc, "labels", None) or ({"region": region} if region else {})
        rep = self.router.add_replica(slot.name, proc.url, proc, labels=labels)
        rep.restarts = slot.restarts
        log.info("%s launched at %s (pid %s)", slot.name, proc.url, proc.pid)

    def _schedule_restart(self, slot: _Slot) -> None:
        cfg = self.config
        slot.backoff = cfg.restart_backoff if slot.backoff == 0 else min(slot.backoff * 2, cfg.restart_backoff_max)
        slot.restart_at = self.clock() + slot.backoff
        slot.restarts += 1
        log.warning("%s: restarting in %.1f s (restart %d)", slot.name, slot.backoff, slot.restarts)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(_WATCH_INTERVAL)
            await self.check()

    async def check(self) -> None:
        """One pass: notice exits and stuck start-ups, relaunch what is due."""
        now = self.clock()
        for slot in list(self.slots.values()):
            if slot.stopping or slot.launching:
                continue
            if slot.process is None:
                if slot.restart_at is not None and now >= slot.restart_at:
                    await self._launch(slot)
                continue
            rep = self.router.replicas.get(slot.name)
            code = await asyncio.to_thread(slot.process.exit_code)
            if rep is not None and rep.healthy_since is not None:
                self.ever_healthy = True
                if not slot.healthy_seen:
                    self._healthy(slot, rep.healthy_since - rep.started_at)
            if code is not None:
                log.error("%s (pid %s) exited with code %s", slot.name, slot.process.pid, code)
                if code == 2 and not self.ever_healthy and (rep is None or rep.breaker.opened_count == 0):
                    # A start-up failure (bad model, bad option) before any replica ever served:
                    # twice in a row (once could be a port taken between choosing and binding it),
                    # and restarting would fail the same way forever.
                    slot.startup_failures += 1
                    if slot.startup_failures >= 2:
                        self.fatal = (f"{slot.name} failed to start twice (exit code 2); its error is in the "
                                      "log above")
                        self.router.notify()  # wait_routable gives up now
            elif rep is not None and rep.healthy_since is None and rep.breaker.opened_count == 0 \
                    and now - rep.started_at > self.config.start_timeout:
                log.error("%s not healthy %.0f s after launch; killing it", slot.name, self.config.start_timeout)
                await asyncio.to_thread(slot.process.kill)
            else:
                if rep is not None and rep.healthy_since is not None and now - rep.healthy_since > _STABLE_AFTER:
                    slot.backoff = 0.0
                continue
            slot.process = None
            self.router.remove_replica(slot.name)
            self._schedule_restart(slot)

    def _healthy(self, slot: _Slot, seconds: float) -> None:
        slot.healthy_seen = True
        if slot.cold:
            log.info("%s: cold start, healthy %.2f s after launch", slot.name, seconds)
            self.cold_starts.append({"replica": slot.name, "wall": round(time.time(), 3),
                                     "time_to_healthy_s": round(seconds, 3)})
            del self.cold_starts[:-20]
            self.cold_start_gauge.set(seconds)

    # ------------------------------------------------------------ scaling
    def signals(self) -> FleetSignals:
        """The fleet as the autoscaler sees it now (the router's measurements over the look-back)."""
        r, lookback = self.router, self.config.lookback
        return FleetSignals(load=r.inflight + r.queue_depth, queued=r.queue_depth,
                            ttft_p95_ms=r.latency.p95_ms("ttft", lookback), tpot_p95_ms=r.latency.p95_ms("tpot", lookback),
                            arrivals=r.latency.count("arrivals", lookback),
                            completions=r.latency.count("completions", lookback),
                            starting=sum(1 for s in self.active if self._starting(s)))

    def _starting(self, slot: _Slot) -> bool:
        rep = self.router.replicas.get(slot.name)
        return slot.launching or (rep is not None and rep.healthy_since is None and rep.breaker.opened_count == 0)

    @property
    def active(self) -> list[_Slot]:
        return [s for s in self.slots.values() if not s.stopping]

    async def _autoscale(self) -> None:
        while True:
            await asyncio.sleep(self.config.autoscale_interval)
            await self.autoscale_once()

    async def autoscale_once(self) -> None:
        """One autoscaler tick: observe, decide, act."""
        now = self.clock()
        self.autoscaler.observe_signals(now, self.signals())
        current = len(self.active)
        target = self.autoscaler.decide(now, current)
        if target != current:
            await self.scale_to(target, self.autoscaler.reason)

    async def scale_to(self, n: int, reason: str = "") -> None:
        n = max(self.config.min_replicas, min(self.config.max_replicas, n))
        active = self.active
        # "at": this supervisor's clock; "wall": Unix time, for the console's timeline.
        self.scale_events.append({"at": round(self.clock(), 3), "wall": round(time.time(), 3), "from": len(active),
                                  "to": n, "reason": reason})
        if n > len(active):
            log.info("scaling up: %d → %d replicas (%s)", len(active), n, reason)
            await asyncio.gather(*(self._launch(self._new_slot()) for _ in range(n - len(active))))
        elif n < len(active):
            log.info("scaling down: %d → %d replicas (draining %d; %s)", len(active), n, len(active) - n, reason)

            def cost(s: _Slot) -> tuple[int, int, int]:
                rep = self.router.replicas.get(s.name)
                # Not-yet-routable replicas first, then the least busy, then the newest.
                return (1 if rep is not None and rep.routable else 0, rep.inflight if rep else 0, -s.index)

            for slot in sorted(active, key=cost)[: len(active) - n]:
                slot.stopping = True
                rep = self.router.replicas.get(slot.name)
                if rep is not None:
                    rep.draining = True  # NOTE: from here the policy never sees it; in-flight requests go on
                task = asyncio.create_task(self._drain(slot))
                self._drains.add(task)
                task.add_done_callback(self._drains.discard)

    async def _drain(self, slot: _Slot) -> None:
        rep = self.router.replicas.get(slot.name)
        if rep is not None:
            if not await self.router.wait_until(lambda: rep.inflight == 0, self.config.drain_timeout):
                log.warning("%s still has %d requests after %.0f s of draining", slot.name, rep.inflight,
                            self.config.drain_timeout)
        proc = slot.process
        if proc is not None:
            await asyncio.to_thread(proc.terminate)  # the server drains too: what is in flight there finishes
            if await asyncio.to_thread(proc.wait, self.config.drain_timeout) is None:
                await asyncio.to_thread(proc.kill)
        self.router.remove_replica(slot.name, saved=True)
        self.slots.pop(slot.index, None)
        log.info("%s drained and stopped", slot.name)

    def down(self) -> list[tuple[str, int, float | None]]:
        """Slots with no process now (crashed, waiting to be relaunched, or launching): (name,
        restarts, seconds until the relaunch or None)."""
        now = self.clock()
        return [(s.name, s.restarts, None if s.restart_at is None else max(0.0, s.restart_at - now))
                for s in self.slots.values() if s.process is None and not s.stopping]

    def info(self) -> dict[str, Any]:
        cfg = self.config
        return {
            "backend": cfg.backend, "min_replicas": cfg.min_replicas, "max_replicas": cfg.max_replicas,
            "active_replicas": len(self.active), "desired_replicas": self.autoscaler.desired(),
            "scale_events": self.scale_events[-50:],
            "restarts": {s.name: s.restarts for s in self.slots.values()},
            "autoscaler": self._autoscaler_info(),
            "cold_starts": self.cold_starts, "held_requests": self.router.latency.held,
        }

    def _autoscaler_info(self) -> dict[str, Any]:
        cfg, sig = self.config, self.signals()
        return {"mode": "slo" if cfg.slo else "inflight", "slo_ttft_p95_ms": cfg.slo_ttft_p95,
                "slo_tpot_p95_ms": cfg.slo_tpot_p95, "lookback_s": cfg.lookback,
                "downscale_delay_s": cfg.downscale_delay, "measured_ttft_p95_ms": sig.ttft_p95_ms,
                "measured_tpot_p95_ms": sig.tpot_p95_ms, "last_reason": self.autoscaler.reason}
