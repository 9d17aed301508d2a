"""Fair share between tenants in the router's admission: when the replicas' capacity (requests in
flight per routable replica, ``--replica-max-inflight``) is taken, requests wait here and are let
through by weighted fair queueing on estimated tokens — the same rule as the engine's scheduler
(``tripod.engine.fairness``): each active tenant has a virtual time (the tokens admitted for it
divided by its weight); a freed place goes to the waiting tenant with the least, so a tenant under
its share never waits behind one over it. Within a tenant, requests go in arrival order.

The tenant is what the router's app put in the ``x-tripod-tenant`` header after authenticating
the request (no header: tenant "", weight 1); its weight comes from ``weight_of``. With capacity
0 (the default) nothing waits here: today's behaviour.

A freed place is not enough when one tenant holds every place: a newcomer would wait for one of its
requests to finish. So, as the engine preempts (``FairShare.preemptions``), the gate lends: each
active tenant's share of the places is in proportion to its weight, and a tenant that would still
be within its share with one more place is let through at once, over the capacity, while another
tenant holds more than its share (the replica's engine then preempts that tenant's request for
it). Places lent are paid back by the over-share tenant's next releases (nothing is granted while
the count is at or over the capacity).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

TENANT_HEADER = "x-tripod-tenant"


class FairGate:
    """Owns the admitted count, each active tenant's virtual time and the queue of waiters.
    Invariant: ``admitted`` counts the acquisitions not yet released (each released once)."""

    def __init__(self, capacity: Callable[[], int], weight_of: Callable[[str], float]) -> None:
        self.capacity = capacity  # <= 0: unbounded (no waiting)
        self.weight_of = weight_of
        self.admitted = 0
        self.vtime: dict[str, float] = {}
        self.live: dict[str, int] = {}  # per tenant: admitted + waiting
        self.granted: dict[str, int] = {}  # per active tenant: places given since it became active
        self.held: dict[str, int] = {}  # per tenant: places it holds now
        self.waiters: dict[str, deque[tuple[asyncio.Future[None], float]]] = {}

    @property
    def waiting(self) -> int:
        return sum(len(q) for q in self.waiters.values())

    def _join(self, tenant: str) -> None:
        if tenant not in self.vtime:
            self.vtime[tenant] = min(self.vtime.values(), default=0.0)
            self.granted[tenant] = 0
        self.live[tenant] = self.live.get(tenant, 0) + 1

    def _leave(self, tenant: str) -> None:
        self.live[tenant] -= 1
        if self.live[tenant] == 0:
            del self.live[tenant], self.vtime[tenant], self.granted[tenant]
            self.waiters.pop(tenant, None)

    def _grant(self, tenant: str, cost: float) -> None:
        self.admitted += 1
        self.granted[tenant] += 1
        self.held[tenant] = self.held.get(tenant, 0) + 1
        self.vtime[tenant] += cost / max(self.weight_of(tenant), 1e-9)

    async def acquire(self, tenant: str, cost: float, timeout: float) -> bool:
        """Wait (up to ``timeout`` s) for a place; False when none came in time."""
        cap = self.capacity()
        self._join(tenant)
        if cap <= 0 or (not self.waiting and self.admitted < cap) or self._lends(tenant, cap):
            self._grant(tenant, cost)
            return True
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiters.setdefault(tenant, deque()).append((fut, cost))
        self.pump()
        try:
            await asyncio.wait_for(asyncio.shield(fut), timeout)
            return True
        except (TimeoutError, asyncio.CancelledError) as e:
            if fut.done() and not fut.cancelled():
                self.release(tenant)  # granted as we gave up: give the place back
            else:
                fut.cancel()
                q = self.waiters.get(tenant)
                if q is not None:
                    self.waiters[tenant] = deque(w for w in q if w[0] is not fut)
                self._leave(tenant)
            if isinstance(e, asyncio.CancelledError):
                raise
            return False

    def _lends(self, tenant: str, cap: int) -> bool:
        """Whether ``tenant`` is under its share of the places while another holds more than its own."""
        if self.waiters.get(tenant):
            return False  # its own earlier requests wait: it takes its turn behind them
        total = sum(max(self.weight_of(t), 1e-9) for t in self.live)
        share = {t: cap * max(self.weight_of(t), 1e-9) / total for t in self.live}
        if self.held.get(tenant, 0) + 1 > share[tenant] + 1e-9:
            return False
        return any(n > share[t] + 1e-9 for t, n in self.held.items() if t in share)

    def release(self, tenant: str) -> None:
        self.admitted -= 1
        self.held[tenant] -= 1
        if not self.held[tenant]:
            del self.held[tenant]
        self._leave(tenant)
        self.pump()

    def pump(self) -> None:
        """Grant free places to waiters, the tenant with the least virtual time first."""
        cap = self.capacity()
        while True:
            ready = [t for t, q in self.waiters.items() if q]
            if not ready or (cap > 0 and self.admitted >= cap):
                return
            # Ties: the tenant admitted fewer times since it became active (a newcomer joins at the
            # others' level: it goes first, then takes turns).
            tenant = min(ready, key=lambda t: (self.vtime[t], self.granted[t]))
            fut, cost = self.waiters[tenant].popleft()
            if fut.cancelled():
                continue
            self._grant(tenant, cost)
            fut.set_result(None)
