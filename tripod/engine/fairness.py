"""Fair share between tenants: weighted fair queueing on tokens.

Each active tenant (one with a request waiting or running) has a virtual time: the tokens the
engine has computed for it (prefill chunks and decode tokens alike) divided by its weight. When
requests wait, the admission order interleaves the tenants by virtual time — the tenant furthest
below its share goes first — and within a tenant keeps the order the ``SchedulePolicy`` gave
(priority first, then fcfs or longest-prefix-match with aging). So under contention each tenant
gets compute in proportion to its weight, and a tenant under its share is never queued behind one
over it.

A tenant that becomes active starts at the smallest virtual time among the active tenants (never
below it): being idle earns no credit to burst with later; a tenant that goes idle is forgotten.
With one tenant (every request's tenant "": no tenants configured) the order is the policy's,
unchanged.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable

from tripod.engine.request import Req


class FairShare:
    """Owns each active tenant's virtual time and weight; never touches KV or the queues."""

    def __init__(self) -> None:
        self.vtime: dict[str, float] = {}
        self.weights: dict[str, float] = {}

    def join(self, req: Req) -> None:
        """``req`` is queued: its tenant becomes active (at the floor) if it was not."""
        self.weights[req.tenant] = req.weight
        if req.tenant not in self.vtime:
            self.vtime[req.tenant] = min(self.vtime.values(), default=0.0)

    def charge(self, tenant: str, tokens: int) -> None:
        """``tokens`` computed for ``tenant`` this step."""
        if tenant in self.vtime:
            self.vtime[tenant] += tokens / self.weights.get(tenant, 1.0)

    def forget_idle(self, active: Iterable[Req]) -> None:
        """Drop tenants with nothing waiting or running (called only while several are known)."""
        live = {r.tenant for r in active}
        for t in [t for t in self.vtime if t not in live]:
            del self.vtime[t]
            self.weights.pop(t, None)

    def order(self, ordered: list[Req]) -> list[Req]:
        """``ordered`` (the policy's order) interleaved by tenant, lowest projected virtual time
        first; each admission is projected to cost its known tokens."""
        queues: dict[str, list[Req]] = {}
        for r in ordered:
            queues.setdefault(r.tenant, []).append(r)
        if len(queues) <= 1:
            return ordered  # NOTE: one tenant (or none): exactly the policy's order
        # (virtual time, the tenant's first position in the policy order, tenant, next index)
        heap = [(self.vtime.get(t, 0.0), ordered.index(q[0]), t, 0) for t, q in queues.items()]
        heapq.heapify(heap)
        out: list[Req] = []
        while heap:
            vt, pos, t, i = heapq.heappop(heap)
            req = queues[t][i]
            out.append(req)
            if i + 1 < len(queues[t]):
                cost = max(req.seq_len - req.computed, 1) / self.weights.get(t, req.weight)
                heapq.heappush(heap, (vt + cost, pos, t, i + 1))
        return out

    def shares(self) -> dict[str, float]:
        """Each active tenant's virtual time (for stats and tests)."""
        return dict(self.vtime)
