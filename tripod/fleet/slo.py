"""SLO autoscaling: replicas from the latency the fleet promised, as the router measured it.

Every tick the supervisor hands in ``FleetSignals`` (the router's p95 TTFT/TPOT over the look-back,
its queue, arrivals and completions). The wish, in order:

1. **from zero**: no replica and a request waiting → one replica, at once (the request is held by
   the router meanwhile; no delay, no cool-down);
2. **up** (+1): a measured p95 over its SLO, or a forecast that says the queue will break it —
   the queue's expected wait (queued / completion rate) over the TTFT SLO, or arrivals outpacing
   completions while requests queue — unless a replica is still starting (it is the answer);
3. **to zero** (``--min-replicas 0``): no request arrived over the look-back and none is in flight;
4. **down** (−1): every measured p95 under ``slo_headroom`` × its SLO, nothing queued, and the
   load would fit in one replica fewer (``target_inflight`` each);
5. otherwise hold.

It never flaps: growing needs the SLO broken, shrinking needs the p95s well under it (the band
between holds: hysteresis); a wish acts only after holding for ``upscale_delay`` (up) or
``downscale_delay`` (down, to zero); and no decision follows another within ``scale_cooldown``.
Each decision keeps its reason (``reason``), which the supervisor records in ``/fleet``. Pure: time
comes in as an argument.
"""

from __future__ import annotations

from dataclasses import dataclass

from tripod.config import FleetConfig


@dataclass(frozen=True, slots=True)
class FleetSignals:
    """What the autoscaler sees of the fleet at one tick."""

    load: float  # requests in flight to replicas + waiting in the router, now
    queued: int  # requests waiting in the router for a replica, now
    ttft_p95_ms: float | None  # over the look-back (None: no sample)
    tpot_p95_ms: float | None
    arrivals: int  # requests that arrived over the look-back
    completions: int  # answers that ended over the look-back
    starting: int = 0  # replicas launched and not yet healthy: capacity on its way


class SloAutoscaler:
    """Owns the latest signals, the pending wish's timer and the time of the last decision."""

    def __init__(self, config: FleetConfig) -> None:
        self.config = config
        self.signals: FleetSignals | None = None
        self.reason = ""
        self._wish: tuple[int, float] | None = None  # (target, since)
        self._last_change = float("-inf")
        self._desired = config.min_replicas

    def observe_signals(self, now: float, signals: FleetSignals) -> None:
        self.signals = signals

    def desired(self) -> int:
        return self._desired

    def _breach(self, s: FleetSignals) -> str | None:
        cfg = self.config
        for name, p95, slo in (("TTFT", s.ttft_p95_ms, cfg.slo_ttft_p95), ("TPOT", s.tpot_p95_ms, cfg.slo_tpot_p95)):
            if slo is not None and p95 is not None and p95 > slo:
                return f"p95 {name} {p95:.0f} ms > SLO {slo:.0f} ms over the last {cfg.lookback:.0f} s"
        if s.queued > 0:
            rate = s.completions / cfg.lookback
            wait_ms = 1000.0 * s.queued / max(rate, 1.0 / cfg.lookback)
            if cfg.slo_ttft_p95 is not None and wait_ms > cfg.slo_ttft_p95:
                return (f"forecast: {s.queued} queued at {rate:.2f} answers/s → ~{wait_ms:.0f} ms wait > TTFT SLO "
                        f"{cfg.slo_ttft_p95:.0f} ms")
            if s.arrivals > 1.1 * s.completions:
                return f"forecast: {s.arrivals} arrivals vs {s.completions} answers over the look-back, {s.queued} queued"
        return None

    def _headroom(self, s: FleetSignals, current: int) -> bool:
        cfg = self.config
        for p95, slo in ((s.ttft_p95_ms, cfg.slo_ttft_p95), (s.tpot_p95_ms, cfg.slo_tpot_p95)):
            if slo is not None and p95 is not None and p95 >= cfg.slo_headroom * slo:
                return False
        return s.queued == 0 and s.load <= (current - 1) * cfg.target_inflight

    def wish(self, current: int) -> tuple[int, str]:
        """The replica count the signals ask for now, and why (before delays and cool-down)."""
        cfg, s = self.config, self.signals
        if s is None:
            return current, "no measurement yet"
        if current == 0:
            if s.load > 0 or s.queued > 0:
                return 1, "scale from zero: a request is held and no replica runs"
            return 0, "idle at zero"
        breach = self._breach(s)
        if breach is not None:
            if s.starting:  # NOTE: the replica on its way is the answer; adding more would overshoot
                return current, f"{breach}; waiting for {s.starting} starting replica(s)"
            return min(cfg.max_replicas, current + 1), breach
        if cfg.min_replicas == 0 and s.arrivals == 0 and s.load == 0:
            return 0, f"no traffic over the last {cfg.lookback:.0f} s"
        if current > max(cfg.min_replicas, 1) and self._headroom(s, current):
            return current - 1, (f"headroom: p95s under {cfg.slo_headroom:.0%} of the SLO and the load "
                                 f"({s.load:.1f}) fits in {current - 1}")
        return current, "within the SLO"

    def decide(self, now: float, current: int) -> int:
        """The replica count to move to now (``current`` when nothing is due)."""
        cfg = self.config
        want, why = self.wish(current)
        want = max(cfg.min_replicas, min(cfg.max_replicas, want))
        self._desired = want
        if want == current:
            self._wish = None
            return current
        urgent = current == 0
        if not urgent and now - self._last_change < cfg.scale_cooldown:
            return current  # NOTE: the wish's timer does not run during a cool-down
        if self._wish is None or (self._wish[0] > current) != (want > current):
            self._wish = (want, now)
        hold = cfg.upscale_delay if want > current else cfg.downscale_delay
        if not urgent and now - self._wish[1] < hold:
            return current
        self._wish = None
        self._last_change = now
        self.reason = why
        return want
