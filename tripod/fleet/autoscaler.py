"""How many replicas the fleet wants, from how busy it has been.

desired = ceil(mean over the look-back window of (requests in flight + requests queued in the
router) / target in-flight per replica), clamped to [min, max]. A wish is acted on only after it has
held for ``upscale_delay`` (growing) or ``downscale_delay`` (shrinking) seconds, so a burst does not
start replicas that the next second would drain — except from zero replicas (``--min-replicas 0``):
a request waiting with no replica starts one at once. Pure: time comes in as an argument.

With an SLO (``--slo-ttft-p95``/``--slo-tpot-p95``) the supervisor uses ``fleet/slo.py`` instead.
"""

from __future__ import annotations

import math
from collections import deque

from tripod.config import FleetConfig
from tripod.fleet.slo import FleetSignals


class Autoscaler:
    """Owns the load samples of the look-back window and the timers of pending wishes."""

    def __init__(self, config: FleetConfig) -> None:
        self.config = config
        self.samples: deque[tuple[float, float]] = deque()
        self._up_since: float | None = None
        self._down_since: float | None = None
        self.reason = ""

    def observe(self, now: float, load: float) -> None:
        self.samples.append((now, load))
        while self.samples and self.samples[0][0] < now - self.config.lookback:
            self.samples.popleft()

    def observe_signals(self, now: float, signals: FleetSignals) -> None:
        self.observe(now, signals.load)

    def _why(self) -> str:
        mean = sum(load for _, load in self.samples) / len(self.samples) if self.samples else 0.0
        return (f"mean load {mean:.2f} over the last {self.config.lookback:.0f} s at "
                f"{self.config.target_inflight:g} per replica")

    def desired(self) -> int:
        cfg = self.config
        if not self.samples:
            return cfg.min_replicas
        mean = sum(load for _, load in self.samples) / len(self.samples)
        return max(cfg.min_replicas, min(cfg.max_replicas, math.ceil(mean / cfg.target_inflight)))

    def decide(self, now: float, current: int) -> int:
        """The replica count to move to now (``current`` when nothing is due)."""
        want = self.desired()
        if current == 0 and want > 0:
            self._up_since = self._down_since = None
            self.reason = "scale from zero: a request is held and no replica runs"
            return want
        if want > current:
            self._down_since = None
            if self._up_since is None:
                self._up_since = now
            if now - self._up_since >= self.config.upscale_delay:
                self._up_since = None
                self.reason = self._why()
                return want
        elif want < current:
            self._up_since = None
            if self._down_since is None:
                self._down_since = now
            if now - self._down_since >= self.config.downscale_delay:
                self._down_since = None
                self.reason = self._why() if want else f"no traffic over the last {self.config.lookback:.0f} s"
                return want
        else:
            self._up_since = self._down_since = None
        return current
