"""The router's parts for shared disk tiers and prefill/decode disaggregation, no HTTP and no model:
evicted prompts move to the tier's tree, replicas on one tier see each other's evictions in their
cache estimate, prefill replicas are never routed to, a hand-over is skipped when the decode
replica has the prompt, and /metrics' tier and transfer counters are read."""

from __future__ import annotations

import random

from tripod.config import RouterConfig
from tripod.router.health import parse_counters
from tripod.router.policy import CacheAwarePolicy, Decision, RouteRequest
from tripod.router.prefix_tree import PrefixTree
from tripod.router.replica import Replica
from tripod.router.router import Router


def test_tree_returns_what_it_evicts_and_lists_its_prompts() -> None:
    tree = PrefixTree(max_chars=20)
    assert tree.insert("abcdefghij", 1.0) == []
    assert tree.insert("abcXYZ", 2.0) == []  # shares "abc"
    assert sorted(tree.texts()) == ["abcXYZ", "abcdefghij"]
    evicted = tree.insert("0123456789", 3.0)  # over budget: the least recently used leaf goes
    assert evicted == ["abcdefghij"] and tree.match("abcdefghij") == 3


def _router(*tiers: str | None) -> tuple[Router, list[Replica]]:
    r = Router(RouterConfig(tree_max_chars=60), rng=random.Random(0))
    reps = []
    for i, tier in enumerate(tiers):
        rep = r.add_replica(f"replica-{i}", f"http://127.0.0.1:{9000 + i}")
        rep.kv_tier = tier
        r.record_success(rep)  # (a good probe: routable, and on its tier)
        reps.append(rep)
    return r, reps


def _send(r: Router, rep: Replica, text: str) -> None:
    rr = RouteRequest(text, len(text) / 4, 0)
    r.end(r.begin(Decision(rep, "load", rep.match(text)), rr, retry=False))


def test_a_prompt_evicted_by_one_replica_counts_as_cached_on_its_tier_mates() -> None:
    r, (a, b, c) = _router("host:/kv/x", "host:/kv/x", None)
    assert a.tier_tree is b.tier_tree is not None and c.tier_tree is None
    old = "S" * 30 + " the old conversation"
    _send(r, a, old)
    assert a.match(old) == len(old) and b.match(old) == 0  # in A's pool only: not on disk yet
    _send(r, a, "T" * 35)  # A's tree evicts the old prompt: its engine writes it to the tier
    assert b.match(old) == len(old) and a.match(old) == len(old) and c.match(old) == 0
    # The cache-aware policy counts it: between B (tier) and C (no tier), equally loaded, B wins.
    d = CacheAwarePolicy(r.config, random.Random(1)).choose([b, c], RouteRequest(old, 40.0, 0), 10.0)
    assert d.replica is b and d.matched_chars == len(old)


def test_a_drained_replica_leaves_its_cache_on_the_tier() -> None:
    r, (a, b) = _router("host:/kv/x", "host:/kv/x")
    _send(r, a, "a prompt A had cached")
    r.remove_replica(a.name, saved=True)  # drained: its engine saved the tree to the tier
    assert b.match("a prompt A had cached") == len("a prompt A had cached")
    r2, (a2, b2) = _router("host:/kv/x", "host:/kv/x")
    _send(r2, a2, "a prompt A had cached")
    r2.remove_replica(a2.name)  # crashed: nothing saved
    assert b2.match("a prompt A had cached") == 0


def test_prefill_replicas_are_not_routed_to_and_short_prompts_skip_the_hand_over() -> None:
    r, (p, d) = _router(None, None)
    p.role, d.role = "prefill", "decode"
    assert r.routable() == [p, d] and r.serving() == [d]
    long = RouteRequest("x" * 800, 200.0, 16)
    assert r.pd.wants("/v1/chat/completions", Decision(d, "load", 0), long)
    assert not r.pd.wants("/v1/messages", Decision(d, "load", 0), long)
    # 190 of 200 estimated tokens cached on the decode replica: a follow-up, prefilled there.
    assert not r.pd.wants("/v1/chat/completions", Decision(d, "cache_hit", 760), long)
    assert r.pd.totals["skipped"] == 1
    p.role = "both"
    assert not r.pd.wants("/v1/chat/completions", Decision(d, "load", 0), long), "no prefill replica: no hand-over"


def test_tier_and_transfer_counters_are_read_from_a_page() -> None:
    page = "\n".join([
        "# HELP tripod:prefix_cache_tier_hits_total prompt tokens served from cache, by tier",
        'tripod:prefix_cache_tier_hits_total{model_name="m",tier="pool"} 120.0',
        'tripod:prefix_cache_tier_hits_total{model_name="m",tier="disk"} 48.0',
        'tripod:pd_kv_received_bytes_total{model_name="m"} 1024.0',
        'tripod:pd_kv_receives_total{model_name="m",outcome="cut"} 1.0',
        'tripod:pd_kv_receive_seconds_sum{model_name="m"} 0.5',
        'tripod:num_requests_running{model_name="m"} 3.0',
    ])
    assert parse_counters(page) == {"tier_hits/pool": 120.0, "tier_hits/disk": 48.0, "pd_kv_received_bytes": 1024.0,
                                    "pd_kv_receives/cut": 1.0, "pd_kv_receive_seconds_sum": 0.5}
