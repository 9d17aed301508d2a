"""Routing policies: given the routable replicas and a request, pick one.

- ``round_robin``: in turn.
- ``least_load``: the power of two choices — two replicas at random, the less loaded one.
- ``cache_aware``: the replica with the lowest cost = (prompt tokens it probably lacks in cache)
  + ``load_weight`` × (its load in tokens), among replicas not already far busier than the least
  busy one (the guard: without it, a hot prefix drags every request onto one replica).
Ties are broken at random so equal replicas share the work.
"""

from __future__ import annotations

import abc
import itertools
import random
from dataclasses import dataclass

from tripod.config import RouterConfig
from tripod.router.replica import Replica


@dataclass(slots=True, frozen=True)
class RouteRequest:
    """What a policy sees of a request: its rendered prompt and an estimate of its size."""

    text: str
    prompt_tokens: float  # estimated
    output_tokens: float  # the request's output budget, as counted into load
    previous_response_id: str | None = None  # a Responses API follow-up (router/affinity.py)


@dataclass(slots=True, frozen=True)
class Decision:
    replica: Replica
    reason: str  # round_robin | least_load | cache_hit | load | balance | affinity
    matched_chars: int  # of the request's text, in the chosen replica's tree


class RoutingPolicy(abc.ABC):
    """Picks a replica; never mutates replicas (the router does the accounting)."""

    name = "base"

    def __init__(self, config: RouterConfig, rng: random.Random | None = None) -> None:
        self.config = config
        self.rng = rng or random.Random()

    @abc.abstractmethod
    def choose(self, replicas: list[Replica], req: RouteRequest, avg_request_tokens: float) -> Decision:
        """One of ``replicas`` (never empty, all routable) for ``req``."""


class RoundRobinPolicy(RoutingPolicy):
    name = "round_robin"

    def __init__(self, config: RouterConfig, rng: random.Random | None = None) -> None:
        super().__init__(config, rng)
        self._counter = itertools.count()

    def choose(self, replicas: list[Replica], req: RouteRequest, avg_request_tokens: float) -> Decision:
        r = replicas[next(self._counter) % len(replicas)]
        return Decision(r, "round_robin", r.match(req.text))


class LeastLoadPolicy(RoutingPolicy):
    name = "least_load"

    def choose(self, replicas: list[Replica], req: RouteRequest, avg_request_tokens: float) -> Decision:
        pair = self.rng.sample(replicas, 2) if len(replicas) > 1 else replicas
        r = min(pair, key=lambda x: (x.inflight, x.load_tokens(avg_request_tokens)))
        return Decision(r, "least_load", r.match(req.text))




class CacheAwarePolicy(RoutingPolicy):
    name = "cache_aware"

    def choose(self, replicas: list[Replica], req: RouteRequest, avg_request_tokens: float) -> Decision:
        cfg = self.config
        least = min(r.inflight for r in replicas)
        limit = cfg.balance_rel * least + cfg.balance_abs
        allowed = [r for r in replicas if r.inflight <= limit]
        chars = max(len(req.text), 1)
        matched = {id(r): r.match(req.text) for r in replicas}
        # A prefix worth fewer than min_match_tokens (a role marker, a common first word: nearly every
        # request shares one) is noise, not a reason to steer: it counts as no match, so unrelated
        # requests tie and spread instead of all following the first replica that saw any.
        floor = cfg.min_match_tokens * chars / req.prompt_tokens if req.prompt_tokens > 0 else float("inf")
        useful = {k: m if m >= floor else 0 for k, m in matched.items()}
        best_cost, best = float("inf"), []
        for r in allowed:
            uncached = req.prompt_tokens * (1.0 - useful[id(r)] / chars)
            cost = uncached + cfg.load_weight * r.load_tokens(avg_request_tokens)
            if cost < best_cost - 1e-9:
                best_cost, best = cost, [r]
            elif abs(cost - best_cost) <= 1e-9:
                best.append(r)
        chosen = self.rng.choice(best)
        top_match = max(useful.values())
        if useful[id(chosen)] > 0 and useful[id(chosen)] == top_match:
            reason = "cache_hit"
        elif top_match > 0 and all(useful[id(r)] < top_match for r in allowed):
            reason = "balance"  # the replica(s) holding the prefix were too busy
        else:
            reason = "load"
        return Decision(chosen, reason, matched[id(chosen)])


def prefer_region(replicas: list[Replica], region: str, overflow_load: float) -> tuple[list[Replica], str]:
    """The candidates a policy sees under regions, and why: ``local`` (this router's region has a
    replica below ``overflow_load`` requests in flight; unlabelled replicas count as local),
    ``overflow`` (every local one is at or past it: the other regions' replicas below it, or every
    replica when none is), ``failover`` (no local one)."""
    if not region:
        return replicas, "local"
    local = [r for r in replicas if r.region in ("", region)]
    if not local:
        return replicas, "failover"
    if len(local) == len(replicas) or any(r.inflight + r.external < overflow_load for r in local):
        return local, "local"
    remote = [r for r in replicas if r.region not in ("", region) and r.inflight + r.external < overflow_load]
    return remote or replicas, "overflow"


POLICIES: dict[str, type[RoutingPolicy]] = {
    p.name: p for p in (RoundRobinPolicy, LeastLoadPolicy, CacheAwarePolicy)
}


def make_policy(config: RouterConfig, rng: random.Random | None = None) -> RoutingPolicy:
    return POLICIES[config.policy](config, rng)
