"""The router's parts with no HTTP and no model: prefix tree, policies, circuit breaker,
autoscaler, supervisor (with fake replica processes), prompt rendering, /metrics parsing."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tripod.config import FleetConfig, RouterConfig
from tripod.fleet.autoscaler import Autoscaler
from tripod.fleet.supervisor import Supervisor
from tripod.router.health import HealthChecker
from tripod.router.policy import (
    CacheAwarePolicy,
    Decision,
    LeastLoadPolicy,
    RoundRobinPolicy,
    RouteRequest,
)
from tripod.router.prefix_tree import PrefixTree
from tripod.router.replica import CircuitBreaker, Replica
from tripod.router.router import Router, parse_load, render_prompt


# ---------------------------------------------------------------- prefix tree
def _lcp(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(alphabet="abc\u00e9\u4e2d", max_size=12), max_size=12), st.text(alphabet="abc\u00e9\u4e2d", max_size=14))
def test_tree_match_is_the_longest_common_prefix_with_anything_inserted(inserted: list[str], query: str) -> None:
    tree = PrefixTree()
    for i, s in enumerate(inserted):
        tree.insert(s, float(i))
    assert tree.match(query) == max((_lcp(s, query) for s in inserted), default=0)
    # size is the number of distinct non-empty prefixes of the inserted strings (one char per trie edge)
    prefixes = {s[:k] for s in inserted for k in range(1, len(s) + 1)}
    assert tree.size == len(prefixes)


def test_tree_evicts_least_recently_used_first() -> None:
    tree = PrefixTree(max_chars=32)
    tree.insert("system prompt A: " + "a" * 5, 1.0)  # 22 chars
    tree.insert("system prompt B", 2.0)  # shares "system prompt " (14): adds 1
    tree.insert("system prompt A: " + "a" * 5, 3.0)  # A used again: B is now the oldest leaf
    tree.insert("zzzzzzzzzz", 4.0)  # 10 more: over budget
    assert tree.size == 32
    assert tree.match("system prompt A: aaaaa") == 22
    assert tree.match("system prompt B") == 14  # B's own character went
    assert tree.match("zzzzzzzzzz") == 10


def test_tree_never_holds_more_than_its_budget() -> None:
    rng = random.Random(0)
    tree = PrefixTree(max_chars=500)
    for t in range(300):
        tree.insert("".join(rng.choice("abcd") for _ in range(rng.randint(1, 60))), float(t))
        assert tree.size <= 500
    last = "dcba" * 10
    tree.insert(last, 1e9)
    assert tree.match(last) == len(last)  # the newest survives eviction


# ---------------------------------------------------------------- policies
def _replicas(n: int, cfg: RouterConfig) -> list[Replica]:
    out = []
    for i in range(n):
        r = Replica(f"r{i}", f"http://r{i}", CircuitBreaker(3, 0), PrefixTree())
        r.breaker.success(0.0)
        out.append(r)
    return out


def _req(text: str, cpt: float = 4.0) -> RouteRequest:
    return RouteRequest(text, len(text) / cpt, 16)


def test_cache_aware_follows_the_prefix() -> None:
    cfg = RouterConfig()
    reps = _replicas(3, cfg)
    convo = "<|system|>" + "long shared instructions " * 40
    reps[1].tree.insert(convo, 0.0)
    policy = CacheAwarePolicy(cfg, random.Random(0))
    d = policy.choose(reps, _req(convo + "<|user|>next question"), 256)
    assert d.replica is reps[1] and d.reason == "cache_hit" and d.matched_chars == len(convo)


def test_cache_aware_leaves_a_hot_replica_past_the_guard() -> None:
    cfg = RouterConfig(balance_abs=2, balance_rel=1.5)
    reps = _replicas(2, cfg)
    hot = "<|system|>" + "the hot prefix " * 50
    for r in reps[:1]:
        r.tree.insert(hot, 0.0)
    reps[0].inflight, reps[0].inflight_tokens = 3, 10.0  # within 1.5 * 0 + 2? no: 3 > 2
    d = CacheAwarePolicy(cfg, random.Random(0)).choose(reps, _req(hot + "q"), 256)
    assert d.replica is reps[1] and d.reason == "balance"
    reps[0].inflight = 2  # back within the guard: the cache wins again
    d = CacheAwarePolicy(cfg, random.Random(0)).choose(reps, _req(hot + "q"), 256)
    assert d.replica is reps[0]


def test_cache_aware_hot_prefix_stays_balanced_under_a_stream_of_requests() -> None:
    """Every request shares one prefix: the guard keeps in-flight counts within its bound."""
    cfg = RouterConfig()
    reps = _replicas(3, cfg)
    policy = CacheAwarePolicy(cfg, random.Random(1))
    hot = "<|system|>" + "everyone shares this " * 30
    for i in range(60):
        d = policy.choose(reps, _req(hot + f"<|user|>q{i}"), 256)
        d.replica.inflight += 1
        d.replica.tree.insert(hot + f"<|user|>q{i}", float(i))
        least = min(r.inflight for r in reps)
        assert max(r.inflight for r in reps) <= cfg.balance_rel * least + cfg.balance_abs + 1


def test_cache_aware_load_outweighs_a_small_cache_hit() -> None:
    cfg = RouterConfig(balance_abs=100)
    reps = _replicas(2, cfg)
    reps[0].tree.insert("<|user|>hi", 0.0)
    reps[0].inflight, reps[0].inflight_tokens = 5, 5000.0
    d = CacheAwarePolicy(cfg, random.Random(0)).choose(reps, _req("<|user|>hi there"), 256)
    assert d.replica is reps[1] and d.reason == "load"


def test_cache_aware_breaks_ties_at_random() -> None:
    cfg = RouterConfig()
    reps = _replicas(3, cfg)
    policy = CacheAwarePolicy(cfg, random.Random(0))
    picks = Counter(policy.choose(reps, _req(f"fresh {i}"), 256).replica.name for i in range(300))
    assert set(picks) == {"r0", "r1", "r2"} and min(picks.values()) > 60, picks


def test_round_robin_and_least_load() -> None:
    cfg = RouterConfig()
    reps = _replicas(3, cfg)
    rr = RoundRobinPolicy(cfg)
    assert [rr.choose(reps, _req("x"), 1).replica.name for _ in range(6)] == ["r0", "r1", "r2"] * 2
    reps[0].inflight, reps[1].inflight, reps[2].inflight = 9, 0, 5
    ll = LeastLoadPolicy(cfg, random.Random(0))
    picks = Counter(ll.choose(reps, _req("x"), 1).replica.name for _ in range(300))
    assert "r0" not in picks  # the busiest of any pair is never picked
    assert picks["r1"] > picks["r2"]


# ---------------------------------------------------------------- circuit breaker
def test_circuit_breaker_opens_and_closes() -> None:
    b = CircuitBreaker(threshold=3, cooldown=5.0)
    assert not b.closed and b.success(0.0) and b.closed  # a new replica: routable on its first success
    assert not b.failure(1.0) and not b.failure(1.1) and b.closed
    b.success(1.2)  # successes reset the count
    assert not b.failure(1.3) and not b.failure(1.4)
    assert b.failure(1.5) and not b.closed  # third in a row
    assert not b.success(3.0) and not b.closed  # within the cooldown
    assert b.success(7.0) and b.closed
    assert b.failure(8.0, fatal=True) and not b.closed  # connection refused: at once


def test_a_replicas_description_keeps_its_json() -> None:
    """``/fleet`` serves ``describe()`` and ``/chain`` encodes ``info()``: the same keys, in the
    same order, as the router's description always had (a Ray replica's actor and node last)."""
    from tripod.protocol.chains import encode

    class RayProcess:
        pid = 7
        actor_name = "tripod-replica-0"
        node_id = "n1"

    rep = Replica("replica-0", "http://127.0.0.1:1", CircuitBreaker(1, 0.0), PrefixTree(), process=RayProcess(),
                  labels={"region": "eu"})
    rep.inflight_tokens, rep.est_prompt_tokens, rep.est_cached_tokens = 12.34, 10.0, 4.0
    d = rep.describe()
    assert list(d) == ["name", "url", "state", "pid", "inflight", "inflight_tokens", "running", "waiting", "routed",
                       "failures", "restarts", "continues", "estimated_hit_rate", "tree_chars", "labels", "role",
                       "kv_tier", "tier_tree_chars", "counters", "actor_name", "node_id"]
    assert d["state"] == "starting" and d["pid"] == 7 and d["inflight_tokens"] == 12.3
    assert d["estimated_hit_rate"] == 0.4 and d["labels"] == {"region": "eu"} and d["node_id"] == "n1"
    assert encode(rep.info()) == encode(d)
    bare = Replica("replica-1", "http://127.0.0.1:2", CircuitBreaker(1, 0.0), PrefixTree())
    assert list(bare.describe())[-1] == "counters" and bare.describe()["pid"] is None
    assert bare.describe()["estimated_hit_rate"] is None


# ---------------------------------------------------------------- autoscaler
def test_autoscaler_waits_for_the_delays_and_clamps() -> None:
    a = Autoscaler(FleetConfig(min_replicas=1, max_replicas=3, target_inflight=4, lookback=10,
                               upscale_delay=5, downscale_delay=20))
    t = 0.0
    for _ in range(5):  # 10 in flight: wants ceil(10/4) = 3 … but only after 5 s
        a.observe(t, 10)
        assert a.decide(t, 1) == 1
        t += 1
    a.observe(t, 10)
    assert a.decide(t, 1) == 3
    a.observe(t + 1, 100)
    assert a.desired() == 3  # clamped at max
    t += 12  # the window forgets the burst
    for _ in range(20):
        a.observe(t, 1)
        assert a.decide(t, 3) == 3
        t += 1
    a.observe(t, 1)
    assert a.decide(t, 3) == 1


def test_autoscaler_ignores_a_blip() -> None:
    a = Autoscaler(FleetConfig(min_replicas=1, max_replicas=4, target_inflight=2, lookback=1, upscale_delay=3))
    a.observe(0.0, 20)
    assert a.decide(0.0, 1) == 1
    a.observe(2.0, 0)  # gone before the delay ran out: the timer resets
    assert a.decide(2.0, 1) == 1
    a.observe(4.0, 0)
    assert a.decide(4.0, 1) == 1


# ---------------------------------------------------------------- supervisor (fake processes)
class FakeProcess:
    def __init__(self, index: int, generation: int) -> None:
        self.name = f"replica-{index}"
        self.url = f"http://fake-{index}-{generation}"
        self.pid = 1000 * generation + index
        self.code: int | None = None
        self.signals: list[str] = []

    def exit_code(self) -> int | None:
        return self.code

    def terminate(self) -> None:
        self.signals.append("TERM")
        self.code = 0

    def kill(self) -> None:
        self.signals.append("KILL")
        self.code = -9

    def wait(self, timeout: float) -> int | None:
        return self.code


class FakeLauncher:
    blocking = True

    def __init__(self) -> None:
        self.launched: list[FakeProcess] = []

    def launch(self, index: int) -> FakeProcess:
        p = FakeProcess(index, len(self.launched))
        self.launched.append(p)
        return p

    def close(self) -> None:
        pass


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_supervisor_restarts_a_dead_replica_with_backoff() -> None:
    async def run() -> None:
        clock = Clock()
        router = Router(RouterConfig(), clock=clock)
        launcher = FakeLauncher()
        sup = Supervisor(router, launcher, FleetConfig(min_replicas=2, max_replicas=2, restart_backoff=1,
                                                       restart_backoff_max=4), clock=clock)
        await sup.start()
        assert sorted(router.replicas) == ["replica-0", "replica-1"]
        first = router.replicas["replica-0"]
        launcher.launched[0].code = -9  # killed
        await sup.check()
        assert "replica-0" not in router.replicas  # out of rotation at once
        await sup.check()
        assert len(launcher.launched) == 2  # the backoff has not run out
        clock.t = 1.0
        await sup.check()
        new = router.replicas["replica-0"]
        assert new is not first and new.url != first.url and new.restarts == 1
        assert not new.routable  # until its first good health probe
        new.breaker.success(clock.t)
        launcher.launched[-1].code = 1  # dies again: the backoff doubles
        await sup.check()
        clock.t = 2.5
        await sup.check()
        assert len(launcher.launched) == 3
        clock.t = 3.0
        await sup.check()
        assert len(launcher.launched) == 4 and sup.info()["restarts"]["replica-0"] == 2
        await sup.stop()
        assert all(p.code is not None for p in launcher.launched)
    asyncio.run(run())


def test_supervisor_waits_for_as_many_replicas_as_asked() -> None:
    """The chain server's start-up waits for every replica of a chainlet (``replicas=n``); a fleet
    is ready at its first."""
    async def run() -> None:
        router = Router(RouterConfig())
        sup = Supervisor(router, FakeLauncher(), FleetConfig(min_replicas=2, max_replicas=2))
        await sup.start()
        both = asyncio.create_task(sup.wait_routable(10.0, replicas=2))
        router.record_success(router.replicas["replica-0"])
        assert await sup.wait_routable(10.0)
        assert not await sup.wait_routable(0.05, replicas=2) and not both.done()
        router.record_success(router.replicas["replica-1"])
        assert await both
        await sup.stop()
    asyncio.run(run())


def test_supervisor_scale_down_drains_before_stopping() -> None:
    async def run() -> None:
        router = Router(RouterConfig())
        launcher = FakeLauncher()
        sup = Supervisor(router, launcher, FleetConfig(min_replicas=1, max_replicas=3, drain_timeout=30))
        await sup.start()
        await sup.scale_to(3)
        for r in router.replicas.values():
            r.breaker.success(0.0)
        busy = router.replicas["replica-2"]
        flight = router.begin(Decision(busy, "load", 0), _req("one request in flight"), retry=False)
        assert busy.inflight == 1
        for name in ("replica-0", "replica-1"):
            router.replicas[name].inflight = 3
        await sup.scale_to(2)  # the least busy one (replica-2) is drained
        assert busy.draining and not busy.routable
        # A negative check needs time: a drain that did not wait would have signalled by now.
        await asyncio.sleep(0.3)
        proc = next(p for p in launcher.launched if p.name == "replica-2")
        assert proc.signals == [] and "replica-2" in router.replicas  # waits for its request
        router.end(flight)  # its request finishes: the drain goes on
        assert await router.wait_until(lambda: "replica-2" not in router.replicas, 5.0)
        assert proc.signals == ["TERM"] and sorted(router.replicas) == ["replica-0", "replica-1"]
        await sup.stop()
    asyncio.run(run())


# ---------------------------------------------------------------- request rendering, /metrics
def test_render_prompt_covers_the_whole_conversation() -> None:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "S"}, {"role": "user", "content": "U1"},
                                  {"role": "assistant", "content": "A1"},
                                  {"role": "user", "content": [{"type": "text", "text": "U2"}]}]
    full = render_prompt("/v1/chat/completions", {"messages": msgs})
    assert full == "<|system|>S\n<|user|>U1\n<|assistant|>A1\n<|user|>U2\n"
    assert full.startswith(render_prompt("/v1/chat/completions", {"messages": msgs[:2]}))
    assert render_prompt("/v1/completions", {"prompt": "abc"}) == "abc"
    assert render_prompt("/v1/completions", {"prompt": ["first", "second"]}) == "first"
    assert render_prompt("/v1/completions", {"prompt": [1, 2, 3]}) == "1 2 3"
    assert render_prompt("/v1/chat/completions", {"messages": "nonsense"}) == ""


def test_render_prompt_same_conversation_same_text_across_apis() -> None:
    """OpenAI chat and Anthropic messages of one conversation (system, tools, a call, its result)
    render to the same text, so the prefix tree follows it whichever API continues it."""
    chat = {"messages": [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "U1"},
        {"role": "assistant", "content": "A1", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"b": 2, "a": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "R1"},
        {"role": "user", "content": "U2"},
    ], "tools": [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}]}
    messages = {"system": [{"type": "text", "text": "S"}], "messages": [
        {"role": "user", "content": "U1"},
        {"role": "assistant", "content": [{"type": "text", "text": "A1"},
                                          {"type": "tool_use", "id": "c1", "name": "f", "input": {"a": 1, "b": 2}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1", "content": "R1"},
                                     {"type": "text", "text": "U2"}]},
    ], "tools": [{"name": "f", "description": "d", "input_schema": {"type": "object"}}]}
    text = render_prompt("/v1/chat/completions", chat)
    assert text == render_prompt("/v1/messages", messages) == render_prompt("/v1/messages/count_tokens", messages)
    assert text.startswith("<|system|>S\n<|tools|>") and text.endswith("<|tool|>R1\n<|user|>U2\n")
    # A longer conversation extends the text of the shorter one.
    shorter = {**messages, "messages": messages["messages"][:2]}
    assert text.startswith(render_prompt("/v1/messages", shorter))


def test_parse_load_reads_tripod_and_vllm_names() -> None:
    page = """# HELP x
tripod:num_requests_running{model_name="m"} 3.0
tripod:num_requests_waiting{model_name="m"} 2.0
tripod:num_requests_running_total 99
"""
    assert parse_load(page) == (3, 2)
    assert parse_load('vllm:num_requests_running{model_name="a"} 4\nvllm:num_requests_waiting 1') == (4, 1)


@pytest.mark.parametrize("bad", [dict(policy="random"), dict(max_retries=-1), dict(health_interval=0)])
def test_router_config_rejects_bad_values(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        RouterConfig(**bad)


def test_fleet_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="min_replicas"):
        FleetConfig(min_replicas=3, max_replicas=2)
    with pytest.raises(ValueError, match="backend"):
        FleetConfig(backend="k8s")


def test_cache_aware_a_role_marker_alone_does_not_steer() -> None:
    """Every chat starts with the same few characters; that is no reason to follow one replica."""
    cfg = RouterConfig()
    reps = _replicas(2, cfg)
    reps[0].tree.insert("<|user|>an earlier, unrelated question", 0.0)
    policy = CacheAwarePolicy(cfg, random.Random(0))
    picks = Counter(policy.choose(reps, _req(f"<|user|>question {i}: " + "words " * 30), 256).replica.name
                    for i in range(200))
    assert min(picks.values()) > 60, picks


def test_cache_aware_keys_prefixes_by_model() -> None:
    """The same prompt under two LoRA adapters (the request's ``model``) is two different cached
    prefixes: a replica holding adapter a's gets no cache-hit preference for adapter b's, and the
    base model (no name, or ``default``) is a third."""
    from tripod.router.prompt import model_scope, render_prompt

    body = {"messages": [{"role": "system", "content": "shared instructions " * 40}, {"role": "user", "content": "q"}]}
    text = render_prompt("/v1/chat/completions", body)
    keys = {m: model_scope({**body, "model": m}) + text for m in ("adapter-a", "adapter-b", "default")}
    assert len(set(keys.values())) == 3 and keys["default"] == text
    cfg = RouterConfig()
    reps = _replicas(2, cfg)
    reps[0].tree.insert(keys["adapter-a"], 0.0)
    policy = CacheAwarePolicy(cfg, random.Random(0))
    assert policy.choose(reps, _req(keys["adapter-a"]), 256).reason == "cache_hit"
    d = policy.choose(reps, _req(keys["adapter-b"]), 256)
    assert d.reason != "cache_hit" and d.matched_chars < len("<|model|>adapter-")  # only the scope's marker


def test_a_request_that_finishes_while_metrics_are_read_is_not_counted_as_another_routers() -> None:
    """The replica's /metrics still counts this router's request, which finishes before the answer
    is read: that request is not load from elsewhere (it would steer the next request away)."""
    rep = Replica("r0", "http://r0", CircuitBreaker(3, 0), PrefixTree())
    rep.breaker.closed = True
    rep.inflight = 1
    page = 'tripod:num_requests_running{model_name="m"} 1\ntripod:num_requests_waiting{model_name="m"} 0\n'

    def metrics(request: Any) -> Any:
        rep.inflight = 0  # this router's request finishes while the page is on its way
        return httpx.Response(200, text=page)

    async def main() -> None:
        checker = HealthChecker(RouterConfig(), lambda: [rep], lambda r: None, lambda r, why, fatal: None)
        checker.client = httpx.AsyncClient(transport=httpx.MockTransport(metrics))
        await checker.scrape(rep)
        await checker.client.aclose()

    asyncio.run(main())
    assert rep.running == 1 and rep.external == 0
