"""The console's server-side sampling (readings, deltas, quantiles, the ring buffer, node events) and
its JSON API (auth, bad input), on fake sources: no server, no model."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Literal

import pytest
from starlette.applications import Starlette
from starlette.testclient import TestClient

from tripod.console.app import Console, is_open_path
from tripod.console.models import FleetView, NodeView
from tripod.console.readings import Reading, delta, histogram_quantile, read_families, read_text
from tripod.console.sampler import SeriesSampler
from tripod.protocol.stats import EngineStats, SpecDecodeCounts
from tripod.server.metrics import ServerMetrics


def test_a_server_page_is_read_by_tripods_names() -> None:
    m = ServerMetrics("m")
    m.on_prompt(100, 40)
    m.on_prompt(50, 0)
    m.generation_tokens.labels("m").inc(30)
    m.request_success.labels("m", "stop").inc(2)
    m.request_success.labels("m", "length").inc(1)
    for v in (0.02, 0.2, 0.4):
        m.ttft.labels("m").observe(v)
    m.on_heartbeat(EngineStats(running=3, waiting=2, kv_slots=100, kv_free=50, kv_cached=10, kv_pinned=0,
                               jump_forward_proposed=20, jump_forward_accepted=15,
                               spec_decode={"ngram": SpecDecodeCounts(4, 16, 8),
                                            "jump_forward": SpecDecodeCounts(5, 20, 15)}))
    for r in (read_families(m.registry.collect()), read_text(m.render().decode())):
        assert r is not None
        assert (r.prompt_tokens, r.cache_queries, r.cache_hits, r.generation_tokens, r.requests) == (150, 150, 40, 30, 3)
        assert (r.running, r.waiting) == (3, 2) and r.kv_usage == pytest.approx(0.4)  # 100 − 50 free − 10 cached
        assert (r.jf_proposed, r.jf_accepted) == (20, 15)
        assert (r.spec_draft, r.spec_accepted) == (16, 8)  # jump-forward's own series are not speculation
        assert r.ttft_buckets[0.025] == 1 and r.ttft_buckets[0.5] == 3 and r.ttft_buckets[float("inf")] == 3
    assert read_text("not { a prometheus page") is None


def test_deltas_see_a_restart_and_quantiles_interpolate() -> None:
    a = Reading(generation_tokens=100, prompt_tokens=50, ttft_buckets={0.1: 2, 1.0: 4, float("inf"): 4})
    b = Reading(generation_tokens=160, prompt_tokens=80, ttft_buckets={0.1: 2, 1.0: 6, float("inf"): 6})
    d = delta(a, b)
    assert (d.generation_tokens, d.prompt_tokens, d.ttft_buckets[1.0], d.ttft_buckets[0.1]) == (60, 30, 2, 0)
    restarted = Reading(generation_tokens=7, prompt_tokens=90)  # a counter went down: a new process
    d = delta(b, restarted)
    assert (d.generation_tokens, d.prompt_tokens) == (7, 90)
    assert delta(None, b).generation_tokens == 0  # a process just found: its totals are not this interval's
    # 10 observations: 4 ≤ 0.1, 8 ≤ 0.5, 10 ≤ 1. p50 = rank 5, in (0.1, 0.5]: 0.1 + 0.4 · (5 − 4) / 4
    h = {0.1: 4, 0.5: 8, 1.0: 10, float("inf"): 10}
    assert histogram_quantile(0.5, h) == pytest.approx(0.2)
    assert histogram_quantile(0.99, h) == pytest.approx(0.5 + 0.5 * (9.9 - 8) / 2)
    assert histogram_quantile(0.99, {0.1: 0, float("inf"): 3}) == 0.1  # in +Inf: the largest finite bound
    assert histogram_quantile(0.5, {0.1: 0, float("inf"): 0}) is None and histogram_quantile(0.5, {}) is None


class FakeSource:
    """A fleet whose nodes and per-process readings the test sets."""

    kind: Literal["server", "fleet"] = "fleet"

    def __init__(self) -> None:
        self.nodes: dict[str, str] = {"replica-0": "healthy", "replica-1": "healthy"}
        self.readings_now: dict[str, Reading] = {}

    def model(self) -> str | None:
        return "m"

    async def fleet(self) -> FleetView:
        return FleetView(kind="fleet", t=0.0, queue_depth=1,
                         nodes=[NodeView(name=n, state=s) for n, s in self.nodes.items()])  # type: ignore[arg-type]

    async def readings(self) -> dict[str, Reading]:
        return dict(self.readings_now)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_the_sampler_turns_readings_into_rates_over_its_window() -> None:
    src, clock = FakeSource(), Clock()
    s = SeriesSampler(src, interval=1.0, window=3.0, history=10.0, clock=clock, wall=lambda: 1000.0 + clock.t)

    def at(t: float, **per_origin: Reading) -> None:
        clock.t = t
        src.readings_now = per_origin
        asyncio.run(s.tick())

    buckets = {0.1: 0.0, 1.0: 0.0, float("inf"): 0.0}
    at(0, a=Reading(generation_tokens=1000, ttft_buckets=dict(buckets)), b=Reading(generation_tokens=5))
    p = s.points[-1]
    assert p.output_tok_s == 0 and p.ttft_p50_ms is None and p.nodes_up == 2 and p.queue_depth == 1
    at(1, a=Reading(generation_tokens=1100, ttft_buckets={0.1: 1.0, 1.0: 2.0, float("inf"): 2.0}, waiting=3,
                    kv_usage=0.5),
       b=Reading(generation_tokens=55, kv_usage=0.1, cache_queries=100, cache_hits=25))
    p = s.points[-1]
    assert p.output_tok_s == pytest.approx(150)  # 100 + 50 tokens in 1 s, summed over the processes
    assert p.ttft_p50_ms == pytest.approx(100.0) and p.queue_depth == 1 + 3
    assert p.kv_usage == pytest.approx(0.3) and p.kv_usage_max == pytest.approx(0.5)
    assert p.prefix_hit_rate == pytest.approx(0.25)  # 25 of the 100 prompt tokens looked up in the second
    assert p.ttft_p99_ms == pytest.approx(100 + 900 * 0.98)  # rank 1.98 of 2, in (0.1, 1.0]
    at(2, a=Reading(generation_tokens=1100), b=Reading(generation_tokens=5))  # both restarted (counters down)
    p = s.points[-1]
    assert p.output_tok_s == pytest.approx((150 + 1100 + 5) / 2)  # a restart: all of the new count is new
    at(5, a=Reading(generation_tokens=1130), b=Reading(generation_tokens=5))
    # The window (3 s) now holds only the ticks at 3..5 (one tick, 3 s long): 30 tokens / 3 s.
    assert s.points[-1].output_tok_s == pytest.approx(10)
    assert [q.t for q in s.since(1002.0)] == [1005.0]
    assert len(s.since(None)) == 4


def test_the_sampler_logs_node_state_changes() -> None:
    src, clock = FakeSource(), Clock()
    s = SeriesSampler(src, interval=1.0, clock=clock, wall=lambda: clock.t)
    asyncio.run(s.tick())
    src.nodes["replica-1"] = "down"
    clock.t = 1
    asyncio.run(s.tick())
    src.nodes["replica-1"] = "starting"
    del src.nodes["replica-0"]
    clock.t = 2
    asyncio.run(s.tick())
    assert [(e.t, e.kind, e.text) for e in s.events] == [
        (0, "added", "replica-0 healthy"), (0, "added", "replica-1 healthy"),
        (1, "state", "replica-1 healthy → down"),
        (2, "state", "replica-1 down → starting"), (2, "removed", "replica-0 removed")]
    assert s.points[-1].nodes_up == 0


def _client(key: str | None, bench_dir: str | None = None) -> TestClient:
    console = Console(FakeSource(), api_key=key, bench_dir=bench_dir)
    app = Starlette(routes=console.routes(), lifespan=console.wrap_lifespan(None))
    return TestClient(app)


def test_the_api_needs_the_key_and_the_page_does_not(tmp_path: object) -> None:
    with _client("sekret") as c:
        for path in ("/ui", "/ui/", "/ui/static/app.js", "/ui/static/style.css"):
            r = c.get(path)
            assert r.status_code == 200 and r.content, path
        assert c.get("/ui/static/app.js").headers["content-type"].startswith("text/javascript")
        for path in ("/ui/api/info", "/ui/api/fleet", "/ui/api/series", "/ui/api/bench"):
            r = c.get(path)
            assert r.status_code == 401 and "no API key" in r.json()["error"]["message"], path
            assert c.get(path, headers={"Authorization": "Bearer wrong"}).status_code == 401
            assert c.get(path, headers={"Authorization": "Bearer sekret"}).status_code == 200
        assert c.get("/ui/api/info", headers={"x-api-key": "sekret"}).json()["auth"] is True
    assert is_open_path("/ui/static/x.js") and not is_open_path("/ui/api/info") and not is_open_path("/uix")


def test_the_api_answers_bad_input_with_4xx() -> None:
    with _client(None) as c:
        r = c.get("/ui/api/series?since=yesterday")
        assert r.status_code == 400 and "'since'" in r.json()["error"]["message"]
        assert c.get("/ui/api/series?since=nan").status_code == 400
        assert c.get("/ui/api/nope").status_code == 404
        assert c.get("/ui/static/nope.js").status_code == 404
        assert c.get("/ui/static/..%2F__init__.py").status_code == 404  # only the shipped files
        info = c.get("/ui/api/info").json()
        assert info["kind"] == "fleet" and info["auth"] is False and info["bench_dir"] is None
        fleet = c.get("/ui/api/fleet").json()
        assert [n["name"] for n in fleet["nodes"]] == ["replica-0", "replica-1"]


def test_tripod_route_mounts_the_console_behind_its_key(tmp_path: object) -> None:
    """``tripod route --api-key K --bench-dir D``: the router (which leaves the API's auth to its
    replicas) guards the console's JSON itself; a replica that does not answer is listed as starting."""
    from tripod.config import RouterConfig
    from tripod.router.app import build_router_app
    from tripod.router.router import Router

    router = Router(RouterConfig(api_key="k", bench_dir=str(tmp_path), health_interval=0.2))
    router.add_replica("replica-0", "http://127.0.0.1:9")  # nothing listens there

    @contextlib.asynccontextmanager
    async def lifespan(_: object) -> AsyncIterator[None]:
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    with TestClient(build_router_app(router, lifespan)) as c:
        assert c.get("/ui").status_code == 200
        assert c.get("/ui/api/fleet").status_code == 401
        f = c.get("/ui/api/fleet", headers={"Authorization": "Bearer k"}).json()
        assert f["kind"] == "fleet" and f["autoscaler"] is None
        assert [(n["name"], n["state"], n["circuit"]) for n in f["nodes"]] == [("replica-0", "starting", "open")]
        b = c.get("/ui/api/bench", headers={"Authorization": "Bearer k"}).json()
        assert b["dir"] == str(tmp_path) and b["runs"] == [] and "no tripod bench results" in b["message"]
        s = c.get("/ui/api/series", headers={"x-api-key": "k"}).json()
        assert s["interval_s"] == 1.0 and all(p["nodes_up"] == 0 for p in s["points"])


class _Proc:
    def __init__(self, index: int) -> None:
        self.name, self.url, self.pid = f"replica-{index}", f"http://127.0.0.1:{9000 + index}", 100 + index
        self.code: int | None = None

    def exit_code(self) -> int | None:
        return self.code

    def terminate(self) -> None:
        self.code = 0

    def kill(self) -> None:
        self.code = -9

    def wait(self, timeout: float) -> int | None:
        return self.code


class _Launcher:
    blocking = False

    def __init__(self) -> None:
        self.procs: list[_Proc] = []

    def launch(self, index: int) -> _Proc:
        self.procs.append(_Proc(index))
        return self.procs[-1]

    def close(self) -> None:
        pass


def test_the_fleet_view_shows_the_autoscaler_scale_events_and_down_slots() -> None:
    from tripod.config import FleetConfig, RouterConfig
    from tripod.fleet.supervisor import Supervisor
    from tripod.router.console_source import RouterConsoleSource
    from tripod.router.router import Router

    async def go() -> tuple[FleetView, FleetView]:
        router = Router(RouterConfig())
        launcher = _Launcher()
        sup = Supervisor(router, launcher, FleetConfig(min_replicas=1, max_replicas=3, target_inflight=4))
        source = RouterConsoleSource(router, sup)
        await sup.scale_to(2)
        up = await source.fleet()
        launcher.procs[1].code = 1  # replica-1 crashes
        await sup.check()
        return up, await source.fleet()

    up, after = asyncio.run(go())
    assert [(n.name, n.state, n.pid) for n in up.nodes] == [("replica-0", "starting", 100), ("replica-1", "starting", 101)]
    assert up.autoscaler is not None and (up.autoscaler.min_replicas, up.autoscaler.max_replicas) == (1, 3)
    assert up.autoscaler.active == 2 and up.autoscaler.target_inflight == 4
    assert [e.text for e in up.events] == ["scale 0 → 2 replicas"] and up.events[0].t > 1e9  # a wall time
    down = next(n for n in after.nodes if n.name == "replica-1")
    assert down.state == "down" and down.restarts == 1 and down.restart_in_s is not None and 0 < down.restart_in_s <= 1.0
