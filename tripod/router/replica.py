"""What the router knows about one replica: its circuit, its load, and what it probably has cached."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import msgspec

from tripod.protocol.fleet import ReplicaInfo
from tripod.router.prefix_tree import PrefixTree


class LaunchedProcess(Protocol):
    """The process behind a replica, when this process launched it (``tripod.fleet`` implements it;
    the router only reads its pid, and ``actor_name``/``node_id`` where the launcher has them)."""

    @property
    def pid(self) -> int | None: ...


class CircuitBreaker:
    """Whether a replica may be sent requests. Closed (routable) until ``threshold`` consecutive
    failures, or one fatal failure (connection refused), open it; an open circuit closes on the
    first success seen at least ``cooldown`` s after it opened. A new replica starts open: it is
    routable from its first good health probe."""

    def __init__(self, threshold: int, cooldown: float) -> None:
        self.threshold = threshold
        self.cooldown = cooldown
        self.closed = False
        self.failures = 0
        self.opened_at = float("-inf")
        self.opened_count = 0

    def success(self, now: float) -> bool:
        """Record a success; True when this closed the circuit."""
        self.failures = 0
        if not self.closed and now - self.opened_at >= self.cooldown:
            self.closed = True
            return True
        return False

    def failure(self, now: float, fatal: bool = False) -> bool:
        """Record a failure; True when this opened the circuit."""
        self.failures += 1
        if self.closed and (fatal or self.failures >= self.threshold):
            self.closed = False
            self.opened_at = now
            self.opened_count += 1
            return True
        if not self.closed and fatal and self.opened_count:
            self.opened_at = now  # still failing: the cooldown starts over (not for a first start-up)
        return False


@dataclass(slots=True, eq=False)
class Replica:
    """One upstream server. Owns the router's view of it; the counters are only touched from the
    router's event loop. ``inflight``/``inflight_tokens`` count requests the router has sent and not
    yet seen finish; ``running``/``waiting`` are the replica's own numbers from its /metrics."""

    name: str
    url: str
    breaker: CircuitBreaker
    tree: PrefixTree
    process: LaunchedProcess | None = None  # set when a supervisor launched it
    draining: bool = False
    inflight: int = 0
    inflight_tokens: float = 0.0
    running: int = 0
    waiting: int = 0
    external: int = 0  # sequences the replica reported beyond the router's own, at the last scrape
    routed: int = 0  # requests sent here (retries included)
    est_prompt_tokens: float = 0.0  # routing-time estimates: prompt tokens sent here …
    est_cached_tokens: float = 0.0  # … and how many of them its tree said were cached
    failures: int = 0  # requests that failed here (before or after the first token)
    started_at: float = 0.0
    healthy_since: float | None = None
    restarts: int = 0
    # A tripod replica that reports resume points and continues answers (its /health says so):
    # the router's mid-answer failover uses it (router/failover.py).
    continues: bool = False
    # Labels (``--replica URL,region=eu-west``; a Ray node's labels): ``region`` steers routing.
    labels: dict[str, str] = field(default_factory=dict)
    # Prefill/decode disaggregation (its /health says): a "prefill" replica only prefills prompts
    # for the others (router/pd.py); "decode" and "both" answer requests.
    role: str = "both"
    # The disk tier it shares with the replicas reporting the same one (host:DIR/<identity>), and
    # the router's tree of what that tier probably holds (shared by those replicas' objects).
    kv_tier: str | None = None
    tier_tree: PrefixTree | None = None
    # Its cache tiers' and KV transfers' counters at the last scrape (health.parse_counters).
    counters: dict[str, float] = field(default_factory=dict)

    def match(self, text: str) -> int:
        """Characters of ``text`` it probably has cached: in its pool (its own tree) or in the disk
        tier it shares (what any replica on that tier evicted there)."""
        own = self.tree.match(text)
        return max(own, self.tier_tree.match(text)) if self.tier_tree is not None else own

    @property
    def region(self) -> str:
        """The replica's region; "" when unlabelled (counted as the router's own region)."""
        return self.labels.get("region", "")

    @property
    def routable(self) -> bool:
        return self.breaker.closed and not self.draining

    def load_tokens(self, avg_request_tokens: float) -> float:
        """Work queued on the replica, in tokens: the router's own in-flight requests, plus what the
        replica reports beyond them (traffic from elsewhere), at the average request size."""
        return self.inflight_tokens + self.external * avg_request_tokens

    def state(self) -> Literal["healthy", "starting", "unhealthy", "draining"]:
        if self.draining:
            return "draining"
        if self.breaker.closed:
            return "healthy"
        return "starting" if self.breaker.opened_count == 0 else "unhealthy"

    def info(self) -> ReplicaInfo:
        """The replica as ``/fleet`` and the chain server's ``/chain`` describe it."""
        extra = {k: getattr(self.process, k) for k in ("actor_name", "node_id") if hasattr(self.process, k)}
        return ReplicaInfo(
            name=self.name, url=self.url, state=self.state(),
            pid=self.process.pid if self.process is not None else None,
            inflight=self.inflight, inflight_tokens=round(self.inflight_tokens, 1),
            running=self.running, waiting=self.waiting, routed=self.routed,
            failures=self.failures, restarts=self.restarts, continues=self.continues,
            estimated_hit_rate=round(self.est_cached_tokens / self.est_prompt_tokens, 4)
            if self.est_prompt_tokens else None,
            tree_chars=self.tree.size, labels=dict(self.labels), role=self.role, kv_tier=self.kv_tier,
            tier_tree_chars=self.tier_tree.size if self.tier_tree is not None else None,
            counters=dict(self.counters), **extra)

    def describe(self) -> dict[str, object]:
        """``info()`` as builtins (the JSON ``/fleet`` serves); an unset Ray field is left out."""
        out: dict[str, object] = msgspec.to_builtins(self.info())
        return out


def parse_replica(spec: str) -> tuple[str, dict[str, str]]:
    """``URL[,key=value...]`` (``tripod route --replica``) → the URL and its labels."""
    url, *pairs = spec.split(",")
    labels: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise ValueError(f"--replica labels are key=value after the URL, e.g. {url},region=eu-west (got {pair!r})")
        labels[key.strip()] = value.strip()
    return url.strip(), labels


@dataclass(slots=True)
class Flight:
    """One attempt in flight to one replica: what the router undoes when it ends (``Router.end``,
    exactly once however the attempt ends)."""

    replica: Replica
    tokens: float  # counted into the replica's inflight_tokens
    done: bool = False
    # Tracing (tripod.tracing; None when off): the attempt's span, ended with the flight, and
    # why the attempt failed (its span's error status).
    span: Any = None
    failure: str | None = None
