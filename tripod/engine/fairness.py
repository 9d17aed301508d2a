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

The order decides who enters a free slot; ``preemptions`` frees one when there is none. Each
active tenant's share of the ``max_running`` slots is in proportion to its weight. A waiting
tenant is *under* its share when one more running request would still be within it; a running
tenant is *over* when it holds more than its share. While both exist in a full batch, the tenant
furthest over gives up its least important request to the waiting one. The two conditions leave
a gap of one slot, so a preemption never causes the opposite one (no thrashing). Free slots are
filled the same way (``slot_order``): requests that would take their tenant past its share of
the slots go after those of tenants under theirs, so the token order never fills the batch in a
way a preemption would then undo.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

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

    def _slots(self, waiting: list[Req], running: list[Req], max_running: int
               ) -> tuple[Counter[str], dict[str, float]]:
        """Running requests per tenant, and each active tenant's share of the slots."""
        counts = Counter(r.tenant for r in running)
        active = {r.tenant for r in waiting} | set(counts)
        total = sum(self.weights.get(t, 1.0) for t in active)
        return counts, {t: max_running * self.weights.get(t, 1.0) / total for t in active}

    def someone_over(self, waiting: list[Req], running: list[Req], max_running: int) -> bool:
        """Whether a running tenant holds more than its share of the slots (a preemption may be due)."""
        counts, share = self._slots(waiting, running, max_running)
        return len(share) > 1 and any(n > share[t] + 1e-9 for t, n in counts.items())

    def slot_order(self, ordered: list[Req], running: list[Req], max_running: int) -> list[Req]:
        """``ordered`` (the admission order) with the requests that would take their tenant past
        its share of the running slots moved after the others (each group keeps its order)."""
        counts, share = self._slots(ordered, running, max_running)
        if len(share) < 2:
            return ordered
        within: list[Req] = []
        beyond: list[Req] = []
        for r in ordered:
            if counts[r.tenant] + 1 <= share[r.tenant] + 1e-9:
                counts[r.tenant] += 1
                within.append(r)
            else:
                beyond.append(r)
        return within + beyond

    def preemptions(self, waiting: list[Req], running: list[Req], max_running: int,
                    importance: Callable[[Req], Any]) -> list[tuple[Req, Req]]:
        """(waiting request to admit, running request to retract for it) pairs, for ``waiting`` in
        admission order and a full ``running`` batch; none with one active tenant."""
        counts, share = self._slots(waiting, running, max_running)
        if len(share) < 2:
            return []
        victims = {t: sorted((r for r in running if r.tenant == t), key=importance) for t in counts}
        eps = 1e-9
        out: list[tuple[Req, Req]] = []
        for req in waiting:
            t = req.tenant
            if counts[t] + 1 > share[t] + eps:
                continue  # admitting it would put its tenant over its share: it waits its turn
            over = [o for o in victims if counts[o] > share[o] + eps and victims[o]]
            if not over:
                break
            o = max(over, key=lambda o: counts[o] / share[o])
            out.append((req, victims[o].pop(0)))
            counts[o] -= 1
            counts[t] += 1
        return out

    def shares(self) -> dict[str, float]:
        """Each active tenant's virtual time (for stats and tests)."""
        return dict(self.vtime)
