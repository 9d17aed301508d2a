"""What ``tripod serve`` tells its console (``tripod.console``): itself as the one node, and its
own metrics registry read in process (no HTTP, no text parsing)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from typing import Literal

from prometheus_client.metrics_core import Metric

from tripod.console.models import FleetView, NodeView
from tripod.console.readings import Reading, read_families
from tripod.server.state import ServerState


class ServerConsoleSource:
    """A ``ConsoleSource`` over one server's state."""

    kind: Literal["server", "fleet"] = "server"

    def __init__(self, state: ServerState) -> None:
        self.state = state

    def model(self) -> str | None:
        return self.state.model_name

    def _reading(self) -> Reading:
        return read_families(self.state.metrics.registry.collect())

    async def fleet(self) -> FleetView:
        s, c = self.state, self.state.client
        r = self._reading()
        node = NodeView(
            name=s.model_name, url=f"http://{s.config.host}:{s.config.port}",
            state="starting" if c.info is None else "dead" if not c.alive else "draining" if s.draining else "healthy",
            pid=os.getpid(), inflight=c.inflight, running=c.stats.running if c.stats else 0,
            waiting=c.stats.waiting if c.stats else 0,
            cached_share=r.cache_hits / r.cache_queries if r.cache_queries > 0 else None, kv_usage=r.kv_usage,
        )
        return FleetView(kind="server", t=time.time(), nodes=[node])

    def tenant_families(self) -> Iterable[Metric]:
        """The per-tenant series (``tripod:tenant_*``), for the console's tenants view."""
        return self.state.metrics.registry.collect()

    async def readings(self) -> dict[str, Reading]:
        return {"server": self._reading()}
