"""The router's admission by tenant fair share (router/fairness.py): unit tests on the gate with
asyncio (no HTTP), and one over real HTTP through a router whose replica holds its requests."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.router.stubs import RouterServer, Stub, wait_for
from tripod.router.fairness import TENANT_HEADER, FairGate


async def _drain(gate: FairGate, backlog: dict[str, int], grants: int) -> list[str]:
    """Tenants queue ``backlog[t]`` requests each behind one admitted request (capacity 1); release
    ``grants`` times and return who got each place, in order."""
    order: list[str] = []
    holder = "seed"
    assert await gate.acquire(holder, 1.0, 1.0)

    async def one(tenant: str) -> None:
        if await gate.acquire(tenant, 100.0, 30.0):
            order.append(tenant)

    tasks = [asyncio.create_task(one(t)) for t, n in backlog.items() for _ in range(n)]
    await asyncio.sleep(0)  # every waiter is queued
    while gate.waiting < sum(backlog.values()):
        await asyncio.sleep(0)
    gate.release(holder)
    for _ in range(grants):
        while len(order) < _ + 1:
            await asyncio.sleep(0)
        gate.release(order[-1])
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return order[:grants]


@pytest.mark.parametrize("weights", [(1.0, 1.0), (3.0, 1.0)])
def test_places_go_by_weight(weights: tuple[float, float]) -> None:
    w = {"a": weights[0], "b": weights[1]}
    gate = FairGate(lambda: 1, lambda t: w.get(t, 1.0))
    order = asyncio.run(_drain(gate, {"a": 200, "b": 200}, 120))
    share_a = order.count("a") / len(order)
    expected = weights[0] / sum(weights)
    assert abs(share_a - expected) <= 0.1 * expected, order


def test_newcomer_under_its_share_goes_before_the_flooder() -> None:
    gate = FairGate(lambda: 1, lambda t: 1.0)
    order = asyncio.run(_drain(gate, {"a": 50, "b": 3}, 8))
    # A had 50 queued before B's 3 arrived; B is served as soon as places free, alternating with A.
    assert order[:6].count("b") == 3, order


def test_no_capacity_means_no_waiting() -> None:
    gate = FairGate(lambda: 0, lambda t: 1.0)

    async def go() -> bool:
        return all([await gate.acquire("a", 1.0, 0.01) for _ in range(100)])

    assert asyncio.run(go()) and gate.admitted == 100


def test_a_waiter_that_times_out_leaves_no_trace() -> None:
    gate = FairGate(lambda: 1, lambda t: 1.0)

    async def go() -> None:
        assert await gate.acquire("a", 1.0, 1.0)
        assert not await gate.acquire("b", 1.0, 0.01)
        assert gate.waiting == 0 and "b" not in gate.vtime
        gate.release("a")
        assert gate.admitted == 0 and not gate.vtime

    asyncio.run(go())


def test_router_admits_the_under_share_tenant_first(make_stub: Callable[[str], Stub],
                                                    make_router: Callable[..., RouterServer], tmp_path: Path) -> None:
    """Two tenants of a tenants file, authenticated by their keys (a tenant named by the client in
    ``x-tripod-tenant`` is ignored: only the router names tenants)."""
    tenants = tmp_path / "tenants.toml"
    tenants.write_text('[[tenant]]\nname = "a"\nkeys = ["key-a"]\n\n[[tenant]]\nname = "b"\nkeys = ["key-b"]\n')
    stub = make_stub("r0")
    stub.mode = "hold"
    rs = make_router([stub], replica_max_inflight=1, queue_timeout=20.0, tenants=str(tenants))
    results: dict[str, int] = {}

    def send(key: str, tenant: str) -> None:
        # NOTE: each claims to be "b" in the header: the router must go by the key.
        r = rs.http.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": key}]},
                         headers={"Authorization": f"Bearer key-{tenant}", TENANT_HEADER: "b"}, timeout=30)
        results[key] = r.status_code

    threads = [threading.Thread(target=send, args=("a0", "a"))]
    threads[0].start()
    wait_for(lambda: stub.active == 1, "the first request to reach the replica")
    for i in range(1, 4):
        threads.append(threading.Thread(target=send, args=(f"a{i}", "a")))
        threads[-1].start()
        wait_for(lambda i=i: rs.router.gate.waiting == i, f"{i} queued")
    threads.append(threading.Thread(target=send, args=("b0", "b")))
    threads[-1].start()
    wait_for(lambda: rs.router.gate.waiting == 4, "b queued")
    stub.mode = "ok"
    stub.release.set()
    for t in threads:
        t.join(30)
    assert set(results.values()) == {200}
    seen = [b["messages"][0]["content"] for b in stub.bodies]
    # B arrived last, behind three of A's, but A was over its share: B went next.
    assert seen[:2] == ["a0", "b0"], seen


def test_a_tenant_under_its_share_is_let_through_over_a_flooder_holding_every_place() -> None:
    """Capacity 4, all of it held by A: B (under its share of 2) does not wait for one of A's to
    end; it is lent a place at once (the replica's engine preempts for it). B's second is lent
    too (2 is its share), its third waits, and so does A's next; A's releases pay the loan back."""

    async def scenario() -> None:
        gate = FairGate(lambda: 4, lambda t: 1.0)
        for _ in range(4):
            assert await gate.acquire("a", 10.0, 1.0)
        assert await gate.acquire("b", 10.0, 0.01)
        assert await gate.acquire("b", 10.0, 0.01)
        assert gate.admitted == 6
        assert not await gate.acquire("b", 10.0, 0.01)  # over its share now: it waits (and times out)
        assert not await gate.acquire("a", 10.0, 0.01)
        waiter = asyncio.create_task(gate.acquire("a", 10.0, 30.0))
        while gate.waiting < 1:
            await asyncio.sleep(0)
        for _ in range(2):
            gate.release("a")  # the loan is paid back: still at capacity, nothing granted
        assert gate.admitted == 4 and not waiter.done()
        gate.release("a")
        assert await waiter
        assert gate.held == {"a": 2, "b": 2}

    asyncio.run(scenario())


def test_no_lending_with_one_tenant_or_a_share_under_one_place() -> None:
    async def scenario() -> None:
        gate = FairGate(lambda: 2, lambda t: 1.0)
        for _ in range(2):
            assert await gate.acquire("a", 1.0, 1.0)
        assert not await gate.acquire("a", 1.0, 0.01)  # one tenant: it waits for its own
        three = FairGate(lambda: 1, lambda t: 1.0)
        assert await three.acquire("a", 1.0, 1.0)
        assert not await three.acquire("b", 1.0, 0.01)  # B's share of one place is 1/2: no loan

    asyncio.run(scenario())
