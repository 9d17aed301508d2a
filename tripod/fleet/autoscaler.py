"""How many replicas the fleet wants, from how busy it has been.

desired = ceil(mean over the look-back window of (requests in flight + requests queued in the
router) / target in-flight per replica), clamped to [min, max]. A wish is acted on only after it has
held for ``upscale_delay`` (growing) or ``downscale_delay`` (shrinking) seconds, so a burst does not
start replicas that the next second would drain. Pure: time comes in as an argument.
"""

from __future__ import annotations

import math
from collections import deque

from tripod.config import FleetConfig


class Autoscaler:
    """Owns the load samples of the look-back window and the timers of pending wishes."""

    def __init__(self, config: FleetConfig) -> None:
        self.config = config
        self.samples: deque[tuple[float, float]] = deque()
        self._up_since: float | None = None
        self._down_since: float | None = None

    def observe(self, now: float, load: float) -> None:
        self.samples.append((now, load))
        while self.samples and self.samples[0][0] < now - self.config.lookback:
            self.samples.popleft()

    def desired(self) -> int:
        cfg = self.config
        if not self.samples:
            return cfg.min_replicas
        mean = sum(load for _, load in self.samples) / len(self.samples)
        return max(cfg.min_replicas, min(cfg.max_replicas, math.ceil(mean / cfg.target_inflight)))

    def decide(self, now: float, current: int) -> int:
        """The replica count to move to now (``current`` when nothing is due)."""
        want = self.desired()
        if want > current:
            self._down_since = None
            if self._up_since is None:
                self._up_since = now
            if now - self._up_since >= self.config.upscale_delay:
                self._up_since = None
                return want
        elif want < current:
            self._up_since = None
            if self._down_since is None:
                self._down_since = now
            if now - self._down_since >= self.config.downscale_delay:
                self._down_since = None
                return want
        else:
            self._up_since = self._down_since = None
        return current
