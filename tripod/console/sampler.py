"""Server-side sampling for the live charts: one ring buffer of points, filled once per interval.

Why on the server and not in the page: the last minutes are there the moment a page opens (and
survive a reload); one scrape per interval however many pages watch; rates and percentiles come
from counter and histogram deltas between readings taken on one clock, per process (so a
replica's restart, which resets its counters, is seen as such); and the page never parses
Prometheus text. The cost is one reading per node per interval (~1 ms each) and a few hundred
small points in memory.

A ``ConsoleSource`` (the server's or the router's; the console imports neither) says what there is:
its nodes (``FleetView``) and each process's metrics (``Reading`` per origin, an origin being one
process: a restarted replica is a new origin).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

from tripod.console.models import FleetEvent, FleetView, SeriesPoint
from tripod.console.readings import Reading, ReadingDelta, delta, histogram_quantile

log = logging.getLogger("tripod.console")


class ConsoleSource(Protocol):
    """What a server or a router tells the console."""

    kind: Literal["server", "fleet"]

    def model(self) -> str | None: ...

    async def fleet(self) -> FleetView:
        """The nodes now (and the supervisor's scale events, if any)."""
        ...

    async def readings(self) -> dict[str, Reading]:
        """Each live process's metrics now, by origin (one key per process)."""
        ...


@dataclass(slots=True)
class _Tick:
    mono: float
    dt: float
    delta: ReadingDelta


class SeriesSampler:
    """Owns the ring buffer of ``SeriesPoint``s, the deltas of the trailing window, and the log of
    node state changes (found by comparing each tick's nodes with the last tick's)."""

    def __init__(self, source: ConsoleSource, interval: float = 1.0, window: float = 5.0, history: float = 600.0,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time,
                 max_events: int = 200) -> None:
        if interval <= 0 or window < interval or history < interval:
            raise ValueError("need 0 < interval <= window and interval <= history")
        self.source = source
        self.interval = interval
        self.window = window
        self.history = history
        self.clock = clock
        self.wall = wall
        self.points: deque[SeriesPoint] = deque(maxlen=int(history / interval) + 1)
        self.events: deque[FleetEvent] = deque(maxlen=max_events)
        self._ticks: deque[_Tick] = deque()
        self._last: dict[str, Reading] = {}
        self._last_mono: float | None = None
        self._states: dict[str, str] = {}
        self._task: asyncio.Task[None] | None = None
        self._failing = False

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        while True:
            try:
                await self.tick()
                if self._failing:
                    log.info("console sampling works again")
                self._failing = False
            except Exception:  # a dashboard must never take the server down; say it once
                if not self._failing:
                    log.exception("console sampling failed (will keep trying)")
                self._failing = True
            await asyncio.sleep(self.interval)

    # ------------------------------------------------------------ one sample
    async def tick(self) -> SeriesPoint:
        fleet = await self.source.fleet()
        readings = await self.source.readings()
        now = self.clock()
        dt = 0.0 if self._last_mono is None else now - self._last_mono
        d = ReadingDelta()
        for origin, reading in readings.items():
            d.add(delta(self._last.get(origin), reading))
        self._last = readings
        self._last_mono = now
        if dt > 0:
            self._ticks.append(_Tick(now, dt, d))
        while self._ticks and self._ticks[0].mono <= now - self.window:
            self._ticks.popleft()
        self._note_states(fleet)
        point = self._point(fleet, readings)
        self.points.append(point)
        return point

    def _point(self, fleet: FleetView, readings: dict[str, Reading]) -> SeriesPoint:
        w = ReadingDelta()
        span = 0.0
        for t in self._ticks:
            w.add(t.delta)
            span += t.dt
        rate = (lambda x: x / span) if span > 0 else (lambda x: 0.0)
        p50 = histogram_quantile(0.5, w.ttft_buckets)
        p99 = histogram_quantile(0.99, w.ttft_buckets)
        kv = [r.kv_usage for r in readings.values() if r.kv_usage is not None]
        return SeriesPoint(
            t=self.wall(),
            output_tok_s=rate(w.generation_tokens), prompt_tok_s=rate(w.prompt_tokens), requests_s=rate(w.requests),
            ttft_p50_ms=None if p50 is None else p50 * 1000, ttft_p99_ms=None if p99 is None else p99 * 1000,
            running=int(sum(r.running for r in readings.values())),
            queue_depth=int(sum(r.waiting for r in readings.values())) + fleet.queue_depth,
            kv_usage=sum(kv) / len(kv) if kv else None, kv_usage_max=max(kv) if kv else None,
            prefix_hit_rate=w.cache_hits / w.cache_queries if w.cache_queries > 0 else None,
            jump_forward_acceptance=w.jf_accepted / w.jf_proposed if w.jf_proposed > 0 else None,
            spec_acceptance=w.spec_accepted / w.spec_draft if w.spec_draft > 0 else None,
            nodes_up=sum(1 for n in fleet.nodes if n.state == "healthy"),
            nodes_desired=fleet.autoscaler.desired if fleet.autoscaler is not None else None,
        )

    def _note_states(self, fleet: FleetView) -> None:
        now = self.wall()
        seen: dict[str, str] = {}
        for n in fleet.nodes:
            seen[n.name] = n.state
            old = self._states.get(n.name)
            if old is None:
                self.events.append(FleetEvent(t=now, kind="added", node=n.name, text=f"{n.name} {n.state}"))
            elif old != n.state:
                self.events.append(FleetEvent(t=now, kind="state", node=n.name, text=f"{n.name} {old} → {n.state}"))
        for name in self._states.keys() - seen.keys():
            self.events.append(FleetEvent(t=now, kind="removed", node=name, text=f"{name} removed"))
        self._states = seen

    # ------------------------------------------------------------ reading the buffer
    def since(self, t: float | None) -> list[SeriesPoint]:
        if t is None:
            return list(self.points)
        return [p for p in self.points if p.t > t]
