"""The router's core: the replica set, the routing policy, and the accounting of what each
replica is sent.

A request is parsed only far enough to render its prompt (``router/prompt.py``) for the policy;
``router/proxy.py`` sends its bytes to the replica picked here and retries elsewhere, and
``router/relay.py`` continues an answer whose replica failed part-way (both, and ``router/pd.py``,
see this router as the ``RouterCore`` of ``router/core.py``). ``router/health.py`` probes the
replicas; its verdicts open and close their circuits here.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
from prometheus_client import Counter
from starlette.responses import Response

from tripod import tracing
from tripod.asgi import ClosingStream
from tripod.config import RouterConfig
from tripod.router.affinity import ResponseAffinity
from tripod.router.errors import RouterError
from tripod.router.fairness import TENANT_HEADER, FairGate
from tripod.router.health import HealthChecker, parse_load
from tripod.router.latency import LatencyWindow, completion_tokens
from tripod.router.metrics import RouterMetrics
from tripod.router.pd import Disaggregator
from tripod.router.policy import Decision, RouteRequest, RoutingPolicy, make_policy, prefer_region
from tripod.router.prefix_tree import PrefixTree
from tripod.router.prompt import (
    DEFAULT_OUTPUT_TOKENS,
    IMAGE_MARK,
    IMAGE_TOKENS,
    image_chars,
    is_anthropic,
    model_scope,
    output_budget,
    render_prompt,
)
from tripod.router.proxy import Proxy
from tripod.router.replica import CircuitBreaker, Flight, LaunchedProcess, Replica

# Re-exported: where the router's callers have always found them.
__all__ = ["Router", "RouterError", "is_anthropic", "parse_load", "render_prompt"]

log = logging.getLogger("tripod.router")


class Router:
    """Owns the replica set, the policy and the health loop, and proxies requests.

    Invariants: a replica's ``inflight`` counts exactly the attempts sent to it that have not ended
    (each ``Flight`` is ended once, by ``end``); ``pending`` counts requests admitted and not yet
    answered (a stream is answered when its last chunk is sent or the client leaves). Everything
    here runs on one event loop; no locks.
    """

    def __init__(self, config: RouterConfig, policy: RoutingPolicy | None = None,
                 clock: Callable[[], float] = time.monotonic, rng: random.Random | None = None,
                 weight_of: Callable[[str], float] | None = None) -> None:
        self.config = config
        self.rng = rng or random.Random()
        self.policy = policy or make_policy(config, self.rng)
        self.clock = clock
        self.replicas: dict[str, Replica] = {}
        # What each shared disk tier (--kv-disk; a replica's /health names it) probably holds: the
        # prompts its replicas' trees evicted (their engines write evicted KV there), and the trees of
        # replicas drained (their engines save their cache there at shutdown).
        self.tiers: dict[str, PrefixTree] = {}
        self.metrics = RouterMetrics()
        self.pending = 0
        self.queue_depth = 0
        self.draining = False
        self.chars_per_token = config.chars_per_token
        self.avg_request_tokens = float(DEFAULT_OUTPUT_TOKENS)
        self._changed = asyncio.Event()
        self.client: httpx.AsyncClient | None = None  # to the replicas, for requests (proxy, relay)
        self.health = HealthChecker(config, lambda: list(self.replicas.values()), self.record_success,
                                    self.record_failure)
        self.pd = Disaggregator(self)  # prefill/decode disaggregation (replicas with roles)
        self.proxy = Proxy(self, self.pd)
        self.affinity = ResponseAffinity()  # response id -> the replica that answered it
        self._closing: set[asyncio.Task[None]] = set()
        # Tenants (router/fairness.py): a tenant's weight; the app that authenticates may replace it.
        self.weight_of: Callable[[str], float] = weight_of or (lambda _tenant: 1.0)
        self.gate = FairGate(self._capacity, lambda t: self.weight_of(t))
        self.latency = LatencyWindow(self.metrics.registry, clock)
        self.cross_region = Counter("tripod:router_cross_region_requests",
                                    "requests sent to a replica outside this router's --region, by reason "
                                    "(overflow: the region was busy; failover: it had no routable replica)",
                                    ["region", "reason"], registry=self.metrics.registry)

    # ------------------------------------------------------------ replica set
    def add_replica(self, name: str, url: str, process: LaunchedProcess | None = None,
                    labels: dict[str, str] | None = None) -> Replica:
        """A new replica starts unroutable; its first good health probe makes it routable."""
        assert name not in self.replicas, name
        rep = Replica(name, url.rstrip("/"), CircuitBreaker(self.config.failure_threshold, self.config.open_cooldown),
                      PrefixTree(self.config.tree_max_chars), process=process, started_at=self.clock(),
                      labels=dict(labels or {}))
        self.replicas[name] = rep
        log.info("replica %s at %s added", name, rep.url)
        return rep

    def remove_replica(self, name: str, saved: bool = False) -> None:
        """``saved``: it stopped cleanly, so its engine saved its prefix cache to its disk tier."""
        rep = self.replicas.pop(name, None)
        if rep is not None:
            if saved and rep.tier_tree is not None:
                for text in rep.tree.texts():
                    rep.tier_tree.insert(text, self.clock())
            log.info("replica %s removed", name)
            self.notify()

    def routable(self) -> list[Replica]:
        return [r for r in self.replicas.values() if r.routable]

    def serving(self) -> list[Replica]:
        """Routable replicas that answer requests (not the prefill replicas of a disaggregated fleet)."""
        return [r for r in self.replicas.values() if r.routable and r.role != "prefill"]

    @property
    def inflight(self) -> int:
        return sum(r.inflight for r in self.replicas.values())

    def notify(self) -> None:
        """Wake everything waiting for the replica set to change (``pick``, ``wait_until``)."""
        # NOTE: waiters hold the old event; setting it wakes them all, and the next wait gets a fresh one.
        self._changed.set()
        self._changed = asyncio.Event()
        self.gate.pump()  # more routable replicas: more places

    async def wait_until(self, cond: Callable[[], bool], timeout: float) -> bool:
        """Wait (up to ``timeout`` s) until ``cond()`` holds; checked at every ``notify``."""
        deadline = self.clock() + timeout
        while not cond():
            left = deadline - self.clock()
            if left <= 0:
                return False
            event = self._changed
            try:
                await asyncio.wait_for(event.wait(), timeout=left)
            except TimeoutError:
                pass
        return True

    def _opened(self, rep: Replica, why: str) -> None:
        rep.healthy_since = None
        rep.tree.clear()  # a replica that failed may have lost its cache: claim nothing
        log.warning("replica %s is out of rotation: %s", rep.name, why)
        self.notify()

    def record_failure(self, rep: Replica, why: str, fatal: bool = False) -> None:
        if rep.breaker.failure(self.clock(), fatal):
            self._opened(rep, why)

    def record_success(self, rep: Replica) -> None:
        if rep.kv_tier is not None and rep.tier_tree is None:
            rep.tier_tree = self.tiers.setdefault(rep.kv_tier, PrefixTree(self.config.tree_max_chars))
        if rep.breaker.success(self.clock()):
            rep.healthy_since = self.clock()
            log.info("replica %s is routable", rep.name)
            self.notify()

    # ------------------------------------------------------------ lifecycle
    @property
    def probe_client(self) -> httpx.AsyncClient | None:
        """The client for health probes, scrapes and ``/v1/models`` (short timeouts)."""
        return self.health.client

    async def start(self) -> None:
        cfg = self.config
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(cfg.request_timeout, connect=cfg.connect_timeout),
                                        limits=limits)
        await self.health.start()

    async def stop(self) -> None:
        await self.health.stop()
        if self.client is not None:
            await self.client.aclose()

    async def probe_all(self) -> None:
        await self.health.probe_all()

    # ------------------------------------------------------------ routing
    def route_request(self, path: str, body: dict[str, Any]) -> RouteRequest:
        text = render_prompt(path, body)
        prev = body.get("previous_response_id") if path == "/v1/responses" else None
        # The cache-aware tree keys the prompt under the model it runs on: a LoRA adapter's prefixes
        # (cached apart from the base's and each other's in the replicas) gather on their own replicas.
        # (an image's tokens are the replica's processor's to count: each is estimated as IMAGE_TOKENS)
        tokens = len(text) / self.chars_per_token + text.count(IMAGE_MARK) * IMAGE_TOKENS
        return RouteRequest(model_scope(body) + text, tokens, output_budget(body),
                            prev if isinstance(prev, str) else None)

    async def pick(self, rr: RouteRequest, tried: set[Replica], wait: bool = True) -> Decision:
        """A decision among routable replicas not yet tried; waits (bounded) for one to appear."""
        deadline = self.clock() + (self.config.queue_timeout if wait else 0.0)
        self.queue_depth += 1
        stuck_since: float | None = None
        try:
            while True:
                routable = self.serving()
                cands = [r for r in routable if r not in tried]
                if cands:
                    return self._choose(cands, rr)
                now = self.clock()
                if routable:
                    # Every routable replica failed this request already. Wait only as long as the
                    # health probes take to notice a dead one (it then leaves the routable set, and
                    # its restarted successor is a new replica worth waiting for); then give up.
                    stuck_since = now if stuck_since is None else stuck_since
                    if now - stuck_since > 2 * self.config.health_interval + self.config.health_timeout:
                        raise RouterError(503, "every routable replica failed this request", "replica_failed",
                                          self.config.retry_after)
                # None routable (all starting, restarting or down): wait, bounded, for one to come back.
                left = deadline - now
                if left <= 0:
                    raise RouterError(503, "no replica is available to serve this request (all are starting, "
                                      "restarting, draining or failing); retry shortly", "no_replica",
                                      self.config.retry_after)
                event = self._changed
                try:
                    await asyncio.wait_for(event.wait(), timeout=min(left, self.config.health_interval))
                except TimeoutError:
                    pass
        finally:
            self.queue_depth -= 1

    def _choose(self, cands: list[Replica], rr: RouteRequest) -> Decision:
        """The policy's choice among ``cands``, this router's region first (``prefer_region``)."""
        cfg = self.config
        if rr.previous_response_id is not None:  # a follow-up: back to the replica that answered, if routable
            name = self.affinity.replica_of(rr.previous_response_id)
            home = next((r for r in cands if r.name == name), None) if name is not None else None
            if home is not None:
                return Decision(home, "affinity", 0)
        cands, why = prefer_region(cands, cfg.region, cfg.region_overflow_load)
        d = self.policy.choose(cands, rr, self.avg_request_tokens)
        if cfg.region and d.replica.region not in ("", cfg.region):
            self.cross_region.labels(d.replica.region, why).inc()
        return d

    def _capacity(self) -> int:
        """Places the fair gate gives out (0: unbounded)."""
        per = self.config.replica_max_inflight
        return per * max(1, len(self.serving())) if per > 0 else 0

    def begin(self, d: Decision, rr: RouteRequest, retry: bool, caches: bool = True,
              continuation: bool = False) -> Flight:
        """Count an attempt on ``d.replica`` into its load (and its tree, ``caches``: the replica
        will hold this prompt in its prefix cache); ``end`` undoes the load. ``continuation``: it
        continues an answer a failed replica had begun (for its span)."""
        rep = d.replica
        share = d.matched_chars / max(len(rr.text), 1)
        cached = rr.prompt_tokens * share
        tokens = rr.prompt_tokens - cached + rr.output_tokens
        rep.inflight += 1
        rep.inflight_tokens += tokens
        rep.routed += 1
        rep.est_prompt_tokens += rr.prompt_tokens
        rep.est_cached_tokens += cached
        if caches:
            evicted = rep.tree.insert(rr.text, self.clock())
            if rep.tier_tree is not None:  # NOTE: the engine writes what its pool evicts to the shared tier
                for text in evicted:
                    rep.tier_tree.insert(text, self.clock())
        self.avg_request_tokens += 0.05 * (rr.prompt_tokens + rr.output_tokens - self.avg_request_tokens)
        self.metrics.routed.labels(rep.name, "retry" if retry else d.reason).inc()
        self.metrics.est_prompt.labels(rep.name).inc(rr.prompt_tokens)
        self.metrics.est_cached.labels(rep.name).inc(cached)
        f = Flight(rep, tokens)
        if tracing.ACTIVE:  # a child of the request's span (the current one)
            f.span = tracing.start_span("router.attempt", kind="client", attributes={
                "tripod.component": "router", "tripod.replica": rep.name, "server.address": rep.url,
                "tripod.retry": retry, "tripod.continuation": continuation, "tripod.route_reason": d.reason})
        return f

    def end(self, f: Flight) -> None:
        """The attempt ended (answered, failed or abandoned): its load leaves the replica. Once."""
        if not f.done:
            f.done = True
            if f.span is not None:
                tracing.end(f.span, error=f.failure)
            rep = f.replica
            rep.inflight -= 1
            rep.inflight_tokens = max(0.0, rep.inflight_tokens - f.tokens) if rep.inflight else 0.0
            if rep.draining and not rep.inflight:
                self.notify()  # a drain waits for this

    def learn(self, rr: RouteRequest, content: bytes) -> None:
        """Refine characters per token from a replica's own count of the prompt."""
        try:
            usage = json.loads(content).get("usage") or {}
            tokens = int(usage.get("prompt_tokens") or 0)
            if not tokens:  # Anthropic's accounting: uncached + read from the cache
                tokens = int(usage.get("input_tokens") or 0) + int(usage.get("cache_read_input_tokens") or 0)
        except (ValueError, AttributeError, TypeError):
            return
        # (an image's tokens have no text: a prompt with images says nothing of characters per token)
        if tokens > 0 and len(rr.text) > 0 and IMAGE_MARK not in rr.text:
            ratio = min(max(len(rr.text) / tokens, 1.0), 16.0)
            self.chars_per_token += 0.1 * (ratio - self.chars_per_token)

    # ------------------------------------------------------------ proxying
    async def forward(self, path: str, raw: bytes, body: dict[str, Any], headers: dict[str, str],
                      admit: Callable[[], Awaitable[Response | None]] | None = None) -> Response:
        """Send one POST to a replica; the answer, or an error once retries are spent
        (``router/proxy.py``). ``admit``: the request's admission into its tenant's limits
        (``router/tenant_limits.py``; its Response, a replica's 4xx to the request, is the
        answer). Then admitted by tenant fair share when capacity is bounded
        (``router/fairness.py``), and timed (``router/latency.py``)."""
        tenant = headers.get(TENANT_HEADER, "")
        t0 = self.latency.clock()
        held = not self.serving()  # a cold start (or every replica down): the request waits for one
        if admit is not None:
            # NOTE: before the arrival is counted: a refused request is no load to scale for.
            early = await admit()
            if early is not None:
                return early
        self.latency.arrived(t0)
        # (an inline image is megabytes of base64 but a few hundred tokens: its characters are not text)
        cost = (len(raw) - image_chars(body)) / self.chars_per_token + output_budget(body)
        self.queue_depth += 1
        # The fair-share queue (--replica-max-inflight): its own span, a child of the request's.
        span = tracing.start_span("router.queue", attributes={
            "tripod.component": "router", "tripod.tenant": tenant, "tripod.queue_depth": self.gate.waiting,
        }) if tracing.ACTIVE and self.config.replica_max_inflight > 0 else None
        admitted = False
        try:
            admitted = await self.gate.acquire(tenant, cost, self.config.queue_timeout)
        finally:
            self.queue_depth -= 1
            if span is not None:
                span.set_attribute("tripod.admitted", admitted)
                tracing.end(span, error=None if admitted else "no place within --queue-timeout")
        if not admitted:
            raise RouterError(503, "every replica is at its capacity (--replica-max-inflight) and this request "
                              "waited its turn past --queue-timeout; retry shortly", "no_capacity",
                              self.config.retry_after)
        try:
            resp = await self.proxy.forward(path, raw, body, headers)
        except BaseException:
            self.gate.release(tenant)
            raise
        return self._timed(resp, tenant, t0, held)

    def _timed(self, resp: Response, tenant: str, t0: float, held: bool) -> Response:
        """Record the answer's latency when it ends, and give its place back (once)."""
        if not isinstance(resp, ClosingStream):
            if resp.status_code == 200:
                self.latency.finished(t0, None, completion_tokens(bytes(resp.body)), held)
            self.gate.release(tenant)
            return resp
        first = self.latency.first_byte(t0, held)
        events = [0]
        inner = resp.body_iterator

        async def counted() -> Any:
            async for chunk in inner:
                events[0] += chunk.count(b"data:") if isinstance(chunk, bytes) else 0
                yield chunk

        resp.body_iterator = counted()
        on_close = resp.on_close

        def closed() -> None:
            try:
                on_close()
            finally:
                self.latency.finished(t0, first, events[0] - 1, held)  # the [DONE] event is no token
                self.gate.release(tenant)

        resp.on_close = closed
        return resp

    def finish_stream(self, f: Flight, resp: httpx.Response) -> None:
        """A stream handed to the client has ended (finished, cut, or the client left)."""
        self.end(f)
        self.pending -= 1
        # NOTE: closing the upstream response drops the connection, which the replica sees as the
        # client leaving: it aborts the request and frees its KV.
        task = asyncio.get_running_loop().create_task(resp.aclose())
        self._closing.add(task)  # NOTE: held until done: the loop keeps only weak references to tasks
        task.add_done_callback(self._closing.discard)
