"""The router's latency measurements (router/latency.py): what the SLO autoscaler reads."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry

from tests.router.stubs import CHAT, MODEL, RouterServer, Stub
from tripod.router.latency import LatencyWindow, percentile


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_percentile_is_nearest_rank() -> None:
    assert percentile([], 0.95) is None
    assert percentile([float(i) for i in range(1, 101)], 0.95) == 95.0
    assert percentile([3.0], 0.95) == 3.0


def test_window_p95s_counts_and_held_requests() -> None:
    clock = Clock()
    w = LatencyWindow(CollectorRegistry(), clock, horizon=60)
    for i in range(20):
        t0 = w.arrived()
        clock.t += 0.1 * (i + 1)  # TTFTs 0.1 .. 2.0 s
        w.first_byte(t0, held=False)
        clock.t += 1.0
        w.finished(t0, t0 + 0.1 * (i + 1), tokens=11, held=False)  # 10 intervals over 1 s: 100 ms
    assert round(w.p95_ms("ttft", 1000) or 0) == 1900
    assert round(w.p95_ms("tpot", 1000) or 0) == 100
    assert w.count("arrivals", 1000) == 20 and w.count("completions", 1000) == 20
    clock.t += 120  # past the horizon: forgotten
    t0 = w.arrived()
    assert w.p95_ms("ttft", 1000) is None and w.count("arrivals", 1000) == 1
    clock.t += 7.5
    w.first_byte(t0, held=True)
    assert w.held[-1]["ttft_s"] == 7.5
    assert w.p95_ms("ttft", 1000) is None  # a cold start is reported as one, not as the fleet's TTFT


def test_router_measures_streams_and_whole_answers(make_stub: Callable[[str], Stub],
                                                   make_router: Callable[..., RouterServer]) -> None:
    rs = make_router([make_stub("r0")])
    client = rs.client()
    list(client.chat.completions.create(model=MODEL, messages=CHAT, stream=True))  # type: ignore[arg-type]
    assert rs.metric("tripod:router_time_to_first_token_seconds_count") == 1
    assert rs.metric("tripod:router_time_per_output_token_seconds_count") == 1  # 3 chunks: 2 intervals
    client.chat.completions.create(model=MODEL, messages=CHAT)  # type: ignore[arg-type]
    assert rs.metric("tripod:router_time_to_first_token_seconds_count") == 1  # a whole answer has no TTFT
    assert rs.metric("tripod:router_time_per_output_token_seconds_count") == 2
    assert rs.metric("tripod:router_held_requests_total") == 0
