"""The router's core as its parts see it: ``RouterCore``, what the proxy (``router/proxy.py``), the
failover relay (``router/relay.py``) and the prefill/decode hand-over (``router/pd.py``) use of
the router that owns them.

``router/router.py``'s ``Router`` is the one implementation. Its parts take this protocol rather
than the class so that ``router.py`` builds them without them importing it back.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any, Protocol

import httpx

from tripod.config import RouterConfig
from tripod.router.metrics import RouterMetrics
from tripod.router.policy import Decision, RouteRequest
from tripod.router.replica import Flight, Replica


class RouterCore(Protocol):
    """The replica set, the choice among replicas, and the accounting of each attempt on one.

    Invariant (kept by the implementation): every ``Flight`` that ``begin`` returns is ended once,
    by ``end`` (``finish_stream`` for a stream handed to the client), which takes its load off
    its replica. Everything runs on the router's one event loop."""

    config: RouterConfig
    metrics: RouterMetrics
    rng: random.Random
    clock: Callable[[], float]
    client: httpx.AsyncClient | None  # to the replicas, for requests (None until started)
    pending: int  # requests admitted and not yet answered
    draining: bool

    def routable(self) -> list[Replica]: ...

    def notify(self) -> None:
        """Wake everything waiting for the replica set to change."""
        ...

    def record_failure(self, rep: Replica, why: str, fatal: bool = False) -> None: ...

    def record_success(self, rep: Replica) -> None: ...

    def route_request(self, path: str, body: dict[str, Any]) -> RouteRequest: ...

    async def pick(self, rr: RouteRequest, tried: set[Replica], wait: bool = True) -> Decision:
        """A decision among routable replicas not in ``tried``; waits (bounded) for one."""
        ...

    def begin(self, d: Decision, rr: RouteRequest, retry: bool, caches: bool = True,
              continuation: bool = False) -> Flight:
        """Count an attempt on ``d.replica`` into its load."""
        ...

    def end(self, f: Flight) -> None:
        """The attempt ended: its load leaves the replica (once)."""
        ...

    def learn(self, rr: RouteRequest, content: bytes) -> None: ...

    def finish_stream(self, f: Flight, resp: httpx.Response) -> None:
        """A stream handed to the client has ended: its flight and its request."""
        ...
