"""The SLO autoscaler (fleet/slo.py) with a fake clock and synthetic measurements, and the
supervisor scaling to zero and back with fake replica processes (no real replicas)."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from tests.router.test_router_units import Clock, FakeLauncher
from tripod.config import FleetConfig, RouterConfig
from tripod.fleet.autoscaler import Autoscaler
from tripod.fleet.slo import FleetSignals, SloAutoscaler
from tripod.fleet.supervisor import Supervisor
from tripod.router.router import Router

CFG = dict(min_replicas=1, max_replicas=4, slo_ttft_p95=500.0, lookback=30, upscale_delay=5, downscale_delay=20,
           scale_cooldown=10, target_inflight=4)


def sig(ttft: float | None = 200.0, tpot: float | None = None, load: float = 2, queued: int = 0,
        arrivals: int = 50, completions: int = 50) -> FleetSignals:
    return FleetSignals(load=load, queued=queued, ttft_p95_ms=ttft, tpot_p95_ms=tpot, arrivals=arrivals,
                        completions=completions)


def run(a: SloAutoscaler, current: int, signals: FleetSignals, start: float, seconds: int) -> tuple[int, float]:
    """Feed ``signals`` once a second; the replica count after, and the time it changed (or -1)."""
    changed = -1.0
    for t in range(seconds):
        now = start + t
        a.observe_signals(now, signals)
        new = a.decide(now, current)
        if new != current and changed < 0:
            changed = now
        current = new
    return current, changed


def test_scales_up_when_the_measured_p95_breaks_the_slo_after_the_delay() -> None:
    a = SloAutoscaler(FleetConfig(**CFG))
    n, at = run(a, 1, sig(ttft=900), 0, 6)
    assert (n, at) == (2, 5.0)  # the wish held for upscale_delay
    assert "p95 TTFT 900 ms > SLO 500 ms" in a.reason


def test_tpot_slo_counts_too() -> None:
    a = SloAutoscaler(FleetConfig(**{**CFG, "slo_ttft_p95": None, "slo_tpot_p95": 50.0}))
    assert run(a, 1, sig(ttft=None, tpot=80.0), 0, 6)[0] == 2 and "TPOT" in a.reason


def test_forecast_from_the_queue_scales_up_before_the_p95_breaks() -> None:
    a = SloAutoscaler(FleetConfig(**CFG))
    # p95 still fine, but 30 queued at 1 answer/s is a ~30 s wait: the SLO will break.
    n, _ = run(a, 2, sig(ttft=300, queued=30, arrivals=60, completions=30), 0, 6)
    assert n == 3 and a.reason.startswith("forecast")


def test_scales_down_only_with_headroom_held_for_the_downscale_delay() -> None:
    a = SloAutoscaler(FleetConfig(**CFG))
    n, at = run(a, 3, sig(ttft=100, load=2), 0, 25)
    assert (n, at) == (2, 20.0) and a.reason.startswith("headroom")


def test_between_headroom_and_the_slo_it_holds() -> None:
    a = SloAutoscaler(FleetConfig(**CFG))
    assert run(a, 3, sig(ttft=400, load=1), 0, 200) == (3, -1.0)  # 400 ms: under the SLO, over 50 % of it


def test_it_never_flaps() -> None:
    """A p95 that swings across the SLO every few seconds moves the fleet at most once per cool-down,
    and never up and straight back down."""
    a = SloAutoscaler(FleetConfig(**CFG))
    current, history = 2, []
    for t in range(300):
        s = sig(ttft=900 if (t // 3) % 2 else 100, load=2)
        a.observe_signals(float(t), s)
        new = a.decide(float(t), current)
        if new != current:
            history.append((t, current, new))
        current = new
    assert not history  # the wish never held for its delay: no decision at all
    # A sustained breach, then a sustained calm: one step up, and down only after the delay.
    n, up = run(a, 2, sig(ttft=900), 300, 12)
    assert n == 3
    n2, down = run(a, 3, sig(ttft=100, load=1), 312, 30)
    assert n2 == 2 and down - up >= CFG["scale_cooldown"] and down - 312 >= CFG["downscale_delay"]


def test_cooldown_spaces_decisions() -> None:
    a = SloAutoscaler(FleetConfig(**{**CFG, "upscale_delay": 0}))
    a.observe_signals(0, sig(ttft=900))
    assert a.decide(0, 1) == 2
    for t in range(1, 10):  # still breaking the SLO, but within the cool-down
        a.observe_signals(t, sig(ttft=900))
        assert a.decide(t, 2) == 2
    a.observe_signals(10, sig(ttft=900))
    assert a.decide(10, 2) == 3


def test_scale_to_zero_after_the_delay_and_back_at_once() -> None:
    a = SloAutoscaler(FleetConfig(**{**CFG, "min_replicas": 0}))
    idle = sig(ttft=None, load=0, arrivals=0, completions=0)
    n, at = run(a, 1, idle, 0, 25)
    assert (n, at) == (0, 20.0) and a.reason.startswith("no traffic")
    a.observe_signals(25, sig(ttft=None, load=1, queued=1, arrivals=1, completions=0))
    assert a.decide(25, 0) == 1 and "zero" in a.reason  # no delay, no cool-down


def test_inflight_autoscaler_scales_from_zero_at_once() -> None:
    a = Autoscaler(FleetConfig(min_replicas=0, max_replicas=2, lookback=10, upscale_delay=5, downscale_delay=3))
    for t in range(3):
        a.observe(float(t), 0)
        assert a.decide(float(t), 1) == 1
    a.observe(3.0, 0)
    assert a.decide(3.0, 1) == 0  # idle for the downscale delay
    a.observe(5.0, 1)
    assert a.decide(5.0, 0) == 1


def test_min_replicas_zero_is_valid_and_max_must_be_positive() -> None:
    assert FleetConfig(min_replicas=0, max_replicas=1).autoscaling
    with pytest.raises(ValueError, match="min_replicas"):
        FleetConfig(min_replicas=0, max_replicas=0)
    with pytest.raises(ValueError, match="slo_ttft_p95"):
        FleetConfig(slo_ttft_p95=0)


def test_supervisor_scales_to_zero_and_records_why() -> None:
    async def go() -> None:
        clock = Clock()
        router = Router(RouterConfig(region="eu"), clock=clock)
        launcher = FakeLauncher()
        cfg = FleetConfig(min_replicas=0, max_replicas=2, lookback=5, downscale_delay=3, upscale_delay=0,
                          slo_ttft_p95=1000)
        sup = Supervisor(router, launcher, cfg, clock=clock)
        await sup.start()
        assert not router.replicas  # min 0: nothing launched
        router.queue_depth = 1  # a request is held
        await sup.autoscale_once()
        rep = router.replicas["replica-0"]
        assert rep.labels == {"region": "eu"}  # a local replica is in the router's region
        clock.t = 2.5
        rep.breaker.success(clock.t)
        rep.healthy_since = clock.t
        await sup.check()
        assert sup.info()["cold_starts"][0]["time_to_healthy_s"] == 2.5
        router.queue_depth = 0
        for t in range(10, 20):  # idle past the look-back and the delay
            clock.t = float(t)
            await sup.autoscale_once()
        events = sup.info()["scale_events"]
        assert [(e["from"], e["to"]) for e in events] == [(0, 1), (1, 0)]
        assert "zero" in events[0]["reason"] and "no traffic" in events[1]["reason"]
        assert sup.info()["autoscaler"]["mode"] == "slo"
        assert await router.wait_until(lambda: not router.replicas, 5)  # drained and removed
        await sup.stop()

    asyncio.run(go())


def test_ray_node_labels_route_by_region() -> None:
    from types import SimpleNamespace

    from tripod.fleet.ray_backend import node_labels

    nodes = [{"NodeID": "n1", "Labels": {"ray.io/node-id": "n1", "region": "eu-west"}}, {"NodeID": "n2"}]
    fake = SimpleNamespace(nodes=lambda: nodes)
    assert node_labels(fake, "n1") == {"region": "eu-west"}
    assert node_labels(fake, "n2") == {} and node_labels(fake, "gone") == {}


def test_no_second_replica_while_one_is_starting() -> None:
    a = SloAutoscaler(FleetConfig(**{**CFG, "upscale_delay": 0, "scale_cooldown": 0}))
    breach = sig(ttft=900)
    assert run(a, 2, replace(breach, starting=1), 0, 30) == (2, -1.0)
    assert "starting" in a.wish(2)[1]
    assert run(a, 2, breach, 30, 1)[0] == 3
