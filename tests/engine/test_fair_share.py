"""Fair share between tenants in the scheduler (engine/fairness.py), without a model: the test
steps the scheduler like ``Engine.step`` with fake tokens (``Sim`` from test_scheduler) and counts
the tokens each tenant gets while both are backlogged."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from tests.engine.test_scheduler import Sim
from tripod.engine.request import Req, SamplingParams
from tripod.engine.scheduler import Scheduler

_arrival = itertools.count(1)


def treq(tenant: str, weight: float = 1.0, prompt: int = 24, max_tokens: int = 12, priority: int = 0,
         base: int = 1) -> Req:
    return Req(prompt_ids=[base + (i % 200) for i in range(prompt)],
               params=SamplingParams(max_tokens=max_tokens, temperature=0.0, priority=priority),
               arrival=float(next(_arrival)), tenant=tenant, weight=weight)


def served_while_backlogged(sim: Sim, steps: int) -> dict[str, int]:
    """Tokens scheduled per tenant over ``steps`` steps (every tenant keeps requests waiting)."""
    got: dict[str, int] = {}
    for _ in range(steps):
        for it in sim.step():
            got[it.req.tenant] = got.get(it.req.tenant, 0) + it.length
        assert all(any(r.tenant == t for r in sim.sched.waiting) for t in got), "a tenant ran dry: add more"
    return got


@pytest.mark.parametrize("weights", [(1.0, 1.0), (3.0, 1.0)])
@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
def test_backlogged_tenants_share_by_weight(weights: tuple[float, float], policy: str) -> None:
    wa, wb = weights
    sim = Sim(max_running=8, max_batch_tokens=64, chunk_size=32, policy=policy)
    # A floods first (it arrived first: today's fcfs would serve it alone), B queues behind.
    sim.add(*(treq("a", wa, base=1) for _ in range(300)))
    sim.add(*(treq("b", wb, base=300, prompt=40, max_tokens=6) for _ in range(300)))
    got = served_while_backlogged(sim, 400)
    share_a = got["a"] / (got["a"] + got["b"])
    expected = wa / (wa + wb)
    assert abs(share_a - expected) <= 0.1 * expected, (got, expected)


def test_tenant_under_its_share_is_never_queued_behind_one_over_it() -> None:
    sim = Sim(max_running=4, max_batch_tokens=64, chunk_size=32, policy="fcfs")
    sim.add(*(treq("a") for _ in range(200)))
    for _ in range(30):  # A alone: it has run far longer than any share
        sim.step()
    late = [treq("b", max_tokens=4) for _ in range(20)]
    sim.add(*late)
    firsts = []
    while any(not r.finished for r in late):
        vt = dict(sim.sched.fair.vtime)
        waiting = {r.tenant for r in sim.sched.waiting}
        before = {r.rid for r in sim.sched.running}
        sim.step()
        new = [r for r in sim.sched.running if r.rid not in before]
        if new and len(waiting) > 1:
            # The step's first admission went to the tenant furthest below its share.
            assert vt[new[0].tenant] == min(vt[t] for t in waiting), (vt, new[0].tenant)
            firsts.append(new[0].tenant)
    # B arrived last behind 170 of A's requests (fcfs), yet it was admitted at least as often as A.
    assert firsts.count("b") >= firsts.count("a"), firsts


def test_priority_still_orders_within_a_tenant() -> None:
    sim = Sim(max_running=1, max_batch_tokens=64, chunk_size=64, policy="fcfs")
    low = treq("a", priority=0)
    high = treq("a", priority=5)
    other = treq("b")
    sim.add(low, high, other)
    sim.run([low, high, other])
    assert sim.admitted.index(high.rid) < sim.admitted.index(low.rid)


def test_one_tenant_keeps_todays_order() -> None:
    """All requests of one tenant (or none): the admission order is the policy's, step for step."""
    def trace(tenant: str, weight: float) -> list[list[tuple[int, int, int]]]:
        global _arrival
        _arrival = itertools.count(1)
        sim = Sim(max_running=3, max_batch_tokens=48, chunk_size=16, policy="lpm", num_slots=512)
        reqs = [treq(tenant, weight, prompt=10 + 7 * (i % 5), max_tokens=3 + i % 4, priority=i % 3,
                     base=1 + 50 * (i % 3)) for i in range(40)]
        sim.add(*reqs)
        steps = []
        while any(not r.finished for r in reqs):
            steps.append([(int(it.req.rid.split("-")[-1]) - int(reqs[0].rid.split("-")[-1]), it.start, it.length)
                          for it in sim.step()])
        return steps

    assert trace("", 1.0) == trace("solo", 2.5)


def test_idle_tenant_earns_no_credit() -> None:
    sim = Sim(max_running=4, max_batch_tokens=64, chunk_size=32, policy="fcfs")
    sched: Scheduler = sim.sched
    sim.add(*(treq("a") for _ in range(50)))
    for _ in range(20):
        sim.step()
    b = treq("b")
    sim.add(b)
    # B joins at A's virtual time, not at zero: it does not get 20 steps of the engine to itself.
    assert sched.fair.vtime["b"] == pytest.approx(min(sched.fair.vtime.values()))
    assert sched.fair.vtime["b"] > 0


def test_weight_must_be_positive() -> None:
    from tripod.protocol import engine_ipc

    ok = engine_ipc.AddRequest("r", [1, 2], SamplingParams(), tenant="acme", weight=2.0)
    back = engine_ipc.decode(engine_ipc.encode(ok))
    assert isinstance(back, engine_ipc.AddRequest) and (back.tenant, back.weight) == ("acme", 2.0)
    bad = engine_ipc.encode(engine_ipc.AddRequest("r", [1, 2], SamplingParams(n=2), weight=0.0))
    with pytest.raises(engine_ipc.InvalidAddRequest) as e:
        engine_ipc.decode(bad)
    assert (e.value.rid, e.value.n) == ("r", 2)


def test_engine_carries_tenant_and_weight_to_the_scheduler(engine: Any) -> None:
    """The real engine: the tenant reaches the Req and the fair share, and (batch composition being
    transparent) a tenant's greedy answer is the answer it gets without tenants."""
    params = SamplingParams(max_tokens=6, temperature=0.0)
    plain = engine.add_request("The capital of France is", params, request_id="plain")
    tagged = engine.add_request("The capital of France is", params, request_id="acme-1", tenant="acme", weight=2.0)
    other = engine.add_request("Once upon a time", params, request_id="beta-1", tenant="beta")
    assert (tagged[0].tenant, tagged[0].weight, other[0].weight) == ("acme", 2.0, 1.0)
    assert set(engine.scheduler.fair.vtime) == {"", "acme", "beta"}
    while engine.has_work:
        engine.step()
    assert tagged[0].output_ids == plain[0].output_ids and len(tagged[0].output_ids) == 6
    with pytest.raises(ValueError, match="weight"):
        engine.add_request("x", params, request_id="bad", tenant="acme", weight=0.0)


def test_under_share_tenant_preempts_a_full_batch_of_an_over_share_one() -> None:
    """A fills every running slot with long answers; B's request is admitted at the next step
    (one of A's is retracted, not waited for), A keeps its share, and nothing thrashes."""
    sim = Sim(max_running=4, max_batch_tokens=64, chunk_size=32, policy="lpm")
    a_reqs = [treq("a", max_tokens=200) for _ in range(8)]
    sim.add(*a_reqs)
    for _ in range(10):
        sim.step()
    assert {r.tenant for r in sim.sched.running} == {"a"} and len(sim.sched.running) == 4
    b = treq("b", max_tokens=4)
    sim.add(b)
    sim.step()
    assert b in sim.sched.running, "B waited behind A's running requests"
    assert [r.tenant for r in sim.sched.running].count("a") == 3
    assert sim.sched.num_fair_preemptions == 1
    sim.run([b, *a_reqs])
    # A at its share (2 of 4) is never preempted for B: one preemption for B's single request.
    assert sim.sched.num_fair_preemptions == 1
    assert all(len(r.output_ids) == r.params.max_tokens for r in [b, *a_reqs])


@pytest.mark.parametrize("weights", [(1.0, 1.0), (3.0, 1.0)])
def test_fair_preemption_respects_weights_and_does_not_thrash(weights: tuple[float, float]) -> None:
    wa, wb = weights
    sim = Sim(max_running=4, max_batch_tokens=64, chunk_size=32, policy="fcfs")
    sim.add(*(treq("a", wa, max_tokens=40) for _ in range(40)))
    for _ in range(5):
        sim.step()
    sim.add(*(treq("b", wb, max_tokens=40) for _ in range(40)))
    share_b = round(4 * wb / (wa + wb))
    sim.step()
    # B's first step: A gave up exactly enough running requests to bring B to its share of slots.
    assert [r.tenant for r in sim.sched.running].count("b") == share_b
    assert sim.sched.num_fair_preemptions == share_b
    got = served_while_backlogged(sim, 300)
    share_a = got["a"] / (got["a"] + got["b"])
    assert abs(share_a - wa / (wa + wb)) <= 0.1 * wa / (wa + wb), got
    # Free slots are filled within the shares of slots, so no preemption is needed again.
    assert sim.sched.num_fair_preemptions == share_b, sim.sched.num_fair_preemptions


def test_one_tenant_is_never_preempted() -> None:
    sim = Sim(max_running=2, max_batch_tokens=64, chunk_size=32, policy="fcfs")
    reqs = [treq("a", max_tokens=20) for _ in range(6)]
    sim.add(*reqs)
    sim.run(reqs)
    assert sim.sched.num_fair_preemptions == 0 and sim.sched.num_retractions == 0


@pytest.mark.slow
def test_preempted_request_resumes_token_exact(engine: Any) -> None:
    """The real engine, greedy: A's answers retracted for B's are the answers A gets alone, token
    for token, and nothing is lost."""
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "The sky is blue because"]
    alone = [engine.add_request(p, params, request_id=f"alone-{i}", tenant="a")[0] for i, p in enumerate(prompts)]
    while engine.has_work:
        engine.step()
    sched = engine.scheduler
    before = sched.num_fair_preemptions
    old_max = sched.max_running
    sched.max_running = len(prompts)
    try:
        shared = [engine.add_request(p, params, request_id=f"a-{i}", tenant="a")[0] for i, p in enumerate(prompts)]
        for _ in range(6):
            engine.step()
        assert len(sched.running) == len(prompts)
        b = engine.add_request("Water boils at", SamplingParams(max_tokens=4, temperature=0.0), request_id="b-1",
                               tenant="b")[0]
        engine.step()
        assert b in sched.running
        while engine.has_work:
            engine.step()
    finally:
        sched.max_running = old_max
    assert sched.num_fair_preemptions > before
    assert any(r.retractions for r in shared)
    assert [r.output_ids for r in shared] == [r.output_ids for r in alone]
    assert len(b.output_ids) == 4
    sched.assert_consistent()
