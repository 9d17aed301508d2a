"""The router's core: the replica set, routing, health, and proxying one request.

A request is parsed only far enough to render its prompt (the whole conversation, the same text
whether it came as OpenAI chat or as Anthropic messages) for the policy;
its bytes go to the replica unchanged and the answer comes back unchanged (a stream chunk by chunk,
never buffered). Failures before the first byte of an answer are retried on another replica.
An OpenAI chat/completions answer from tripod replicas that fails after it has begun is continued
on another replica (``router/failover.py``): the client's stream simply goes on, a whole answer is
completed where the first replica stopped. Elsewhere (other APIs, other servers, continuations
spent) a stream cut after its first chunk ends with an error event, never a silent second answer.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import httpx
from starlette.responses import Response

from tripod.asgi import ClosingStream
from tripod.config import RouterConfig
from tripod.router.failover import AnswerProgress, Failed, SSESplitter, supports_failover
from tripod.router.metrics import RouterMetrics
from tripod.router.policy import Decision, RouteRequest, RoutingPolicy, make_policy
from tripod.router.prefix_tree import PrefixTree
from tripod.router.replica import CircuitBreaker, Replica, ReplicaProcess

log = logging.getLogger("tripod.router")

# A replica answering one of these has not started an answer: another replica may serve it.
_RETRYABLE = {429, 500, 502, 503, 504, 529}
_FULL = {429, 529}  # a replica at capacity (529: Anthropic's overloaded_error)
# Requests whose prompt the replica caches (others, like count_tokens, only use it for the choice).
_GENERATING = {"/v1/chat/completions", "/v1/completions", "/v1/messages"}
# Anthropic's error types by status; other statuses are api_error.
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                    405: "invalid_request_error", 413: "request_too_large", 429: "rate_limit_error",
                    529: "overloaded_error"}


def is_anthropic(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")
_HOP_HEADERS = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "upgrade",
                "proxy-authorization", "proxy-connection", "accept-encoding"}
_PASS_BACK = ("content-type", "retry-after", "x-request-id", "cache-control")
_DEFAULT_OUTPUT = 256  # output budget counted into load when a request names none


class RouterError(Exception):
    """An answer the router gives itself, as an OpenAI-style error body."""

    def __init__(self, status: int, message: str, code: str, retry_after: int | None = None,
                 anthropic_status: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.retry_after = retry_after
        self.anthropic_status = anthropic_status or status  # e.g. 529 where OpenAI's side says 429

    def response(self, anthropic: bool = False) -> Response:
        """The error in OpenAI's shape, or in Anthropic's (for ``/v1/messages``)."""
        headers = {"Retry-After": str(self.retry_after)} if self.retry_after is not None else None
        if anthropic:
            status = self.anthropic_status
            err = {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(status, "api_error"),
                                              "message": self.message}}
            return Response(json.dumps(err), status_code=status, media_type="application/json", headers=headers)
        kind = "invalid_request_error" if self.status < 500 and self.status != 429 else "server_error"
        body = {"error": {"message": self.message, "type": kind, "param": None, "code": self.code}}
        return Response(json.dumps(body), status_code=self.status, media_type="application/json", headers=headers)


def _args(value: Any) -> str:
    """A call's arguments in one canonical layout (OpenAI sends JSON text, Anthropic an object)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return value
    return json.dumps(value, sort_keys=True)


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content
                       if isinstance(p, dict) and p.get("type", "text") == "text")
    return content if isinstance(content, str) else ""


def _turn(role: str, content: str, calls: list[tuple[str, str]] | None = None) -> str:
    return f"<|{role}|>{content}" + "".join(f"<|call|>{n}{a}" for n, a in calls or []) + "\n"


def _tools_text(tools: Any) -> str:
    if not isinstance(tools, list) or not tools:
        return ""
    canon = []
    for t in tools:
        if not isinstance(t, dict):
            continue
        fn = t["function"] if isinstance(t.get("function"), dict) else t  # OpenAI nests it, Anthropic not
        canon.append([fn.get("name"), fn.get("description"), fn.get("parameters", fn.get("input_schema"))])
    return "<|tools|>" + json.dumps(canon, sort_keys=True) + "\n"


def _chat_text(body: dict[str, Any]) -> str:
    out = []
    msgs = [m for m in body.get("messages") or [] if isinstance(m, dict)]
    # A chat template puts the system message first, and the tools with it (or in it).
    if msgs and msgs[0].get("role") in ("system", "developer"):
        out.append(_turn("system", _text(msgs.pop(0).get("content"))))
    out.append(_tools_text(body.get("tools")))
    for m in msgs:
        calls = [(str(c["function"].get("name")), _args(c["function"].get("arguments")))
                 for c in m.get("tool_calls") or [] if isinstance(c, dict) and isinstance(c.get("function"), dict)]
        out.append(_turn(str(m.get("role", "")), _text(m.get("content")), calls))
    return "".join(out)


def _messages_text(body: dict[str, Any]) -> str:
    """An Anthropic conversation as the same text as its OpenAI equivalent: system first, text
    blocks as content, tool_use blocks as calls, each tool_result block as a tool message."""
    out = []
    system = _text(body.get("system"))
    if system:
        out.append(_turn("system", system))
    out.append(_tools_text(body.get("tools")))
    for m in body.get("messages") or []:
        if not isinstance(m, dict):
            continue
        role, content = str(m.get("role", "")), m.get("content")
        if not isinstance(content, list):
            out.append(_turn(role, _text(content)))
            continue
        text: list[str] = []
        calls: list[tuple[str, str]] = []
        for b in content:
            if not isinstance(b, dict):
                continue
            if b.get("type") == "tool_result":
                if text:
                    out.append(_turn(role, "".join(text)))
                    text = []
                out.append(_turn("tool", _text(b.get("content"))))
            elif b.get("type") == "tool_use":
                calls.append((str(b.get("name")), _args(b.get("input") or {})))
            else:
                text.append(_text([b]))
        if text or calls:
            out.append(_turn(role, "".join(text), calls))
    return "".join(out)


def render_prompt(path: str, body: dict[str, Any]) -> str:
    """The text a replica's prefix cache would hold for this request: every message of a chat (role
    and content, tool calls and results, in order; the same text for OpenAI chat and Anthropic
    messages), or a completion's prompt (the first one of a batch)."""
    if path.endswith("chat/completions"):
        return _chat_text(body)
    if is_anthropic(path):
        return _messages_text(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt:
        prompt = prompt[0] if not isinstance(prompt[0], int) else prompt
        if isinstance(prompt, list):
            return " ".join(str(t) for t in prompt)
    return prompt if isinstance(prompt, str) else ""


def _output_budget(body: dict[str, Any]) -> float:
    limit = body.get("max_completion_tokens") or body.get("max_tokens") or _DEFAULT_OUTPUT
    n = body.get("n") or 1
    try:
        return float(min(int(limit), 4096) * min(int(n), 16))
    except (TypeError, ValueError):
        return float(_DEFAULT_OUTPUT)


@dataclass(slots=True)
class _Flight:
    """One attempt in flight to one replica: what to undo when it ends."""

    replica: Replica
    tokens: float
    done: bool = False


@dataclass(slots=True)
class _Run:
    """A stream under failover: the attempt serving it now (a continuation replaces it), what it
    needs to continue elsewhere, and what its ``on_close`` must undo."""

    flight: _Flight
    resp: httpx.Response
    answer: AnswerProgress
    path: str
    headers: dict[str, str]
    rr: RouteRequest
    tried: set[Replica]


class Router:
    """Owns the replica set, the policy and the health loop, and proxies requests.

    Invariants: a replica's ``inflight`` counts exactly the attempts sent to it that have not ended
    (each ``_Flight`` is ended once); ``pending`` counts requests admitted and not yet answered
    (a stream is answered when its last chunk is sent or the client leaves). Everything here runs
    on one event loop; no locks.
    """

    def __init__(self, config: RouterConfig, policy: RoutingPolicy | None = None,
                 clock: Callable[[], float] = time.monotonic, rng: random.Random | None = None) -> None:
        self.config = config
        self.rng = rng or random.Random()
        self.policy = policy or make_policy(config, self.rng)
        self.clock = clock
        self.replicas: dict[str, Replica] = {}
        self.metrics = RouterMetrics()
        self.pending = 0
        self.queue_depth = 0
        self.draining = False
        self.chars_per_token = config.chars_per_token
        self.avg_request_tokens = float(_DEFAULT_OUTPUT)
        self._changed = asyncio.Event()
        self._client: httpx.AsyncClient | None = None
        self.probe_client: httpx.AsyncClient | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._closing: set[asyncio.Task[None]] = set()

    # ------------------------------------------------------------ replica set
    def add_replica(self, name: str, url: str, process: ReplicaProcess | None = None) -> Replica:
        """A new replica starts unroutable; its first good health probe makes it routable."""
        assert name not in self.replicas, name
        rep = Replica(name, url.rstrip("/"), CircuitBreaker(self.config.failure_threshold, self.config.open_cooldown),
                      PrefixTree(self.config.tree_max_chars), process=process, started_at=self.clock())
        self.replicas[name] = rep
        log.info("replica %s at %s added", name, rep.url)
        return rep

    def remove_replica(self, name: str) -> None:
        rep = self.replicas.pop(name, None)
        if rep is not None:
            log.info("replica %s removed", name)
            self.notify()

    def routable(self) -> list[Replica]:
        return [r for r in self.replicas.values() if r.routable]

    @property
    def inflight(self) -> int:
        return sum(r.inflight for r in self.replicas.values())

    def notify(self) -> None:
        """Wake everything waiting for the replica set to change (``pick``, ``wait_until``)."""
        # NOTE: waiters hold the old event; setting it wakes them all, and the next wait gets a fresh one.
        self._changed.set()
        self._changed = asyncio.Event()

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
        if rep.breaker.success(self.clock()):
            rep.healthy_since = self.clock()
            log.info("replica %s is routable", rep.name)
            self.notify()

    # ------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        cfg = self.config
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(cfg.request_timeout, connect=cfg.connect_timeout),
                                         limits=limits)
        self.probe_client = httpx.AsyncClient(timeout=cfg.health_timeout)
        self._tasks = [asyncio.create_task(self._every(cfg.health_interval, self._probe)),
                       asyncio.create_task(self._every(cfg.metrics_interval, self._scrape))]
        await self.probe_all()

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for c in (self._client, self.probe_client):
            if c is not None:
                await c.aclose()

    async def probe_all(self) -> None:
        await asyncio.gather(*(self._probe(r) for r in list(self.replicas.values())))

    async def _every(self, interval: float, fn: Callable[[Replica], Any]) -> None:
        while True:
            await asyncio.sleep(interval)
            await asyncio.gather(*(fn(r) for r in list(self.replicas.values())), return_exceptions=True)

    async def _probe(self, rep: Replica) -> None:
        assert self.probe_client is not None
        try:
            r = await self.probe_client.get(rep.url + "/health")
        except httpx.ConnectError as e:
            self.record_failure(rep, f"health probe: cannot connect ({e})", fatal=True)
            return
        except httpx.HTTPError as e:
            self.record_failure(rep, f"health probe: {type(e).__name__}")
            return
        if r.status_code == 200:
            try:
                rep.continues = r.json().get("continuation") is True
            except (ValueError, AttributeError):
                rep.continues = False
            self.record_success(rep)
        else:
            # NOTE: a replica that answers 503 (draining, engine dead) asks to get nothing more.
            self.record_failure(rep, f"health probe answered {r.status_code}", fatal=True)

    async def _scrape(self, rep: Replica) -> None:
        if not rep.breaker.closed:
            return
        assert self.probe_client is not None
        try:
            r = await self.probe_client.get(rep.url + "/metrics")
        except httpx.HTTPError:
            return
        if r.status_code == 200:
            running, waiting = parse_load(r.text)
            rep.running, rep.waiting = running, waiting
            # NOTE: taken against the in-flight count of this moment; later finishes are seen by the
            # router at once, so stale running/waiting numbers never count twice.
            rep.external = max(0, running + waiting - rep.inflight)

    # ------------------------------------------------------------ routing
    def route_request(self, path: str, body: dict[str, Any]) -> RouteRequest:
        text = render_prompt(path, body)
        return RouteRequest(text, len(text) / self.chars_per_token, _output_budget(body))

    async def pick(self, rr: RouteRequest, tried: set[Replica], wait: bool = True) -> Decision:
        """A decision among routable replicas not yet tried; waits (bounded) for one to appear."""
        deadline = self.clock() + (self.config.queue_timeout if wait else 0.0)
        self.queue_depth += 1
        stuck_since: float | None = None
        try:
            while True:
                routable = self.routable()
                cands = [r for r in routable if r not in tried]
                if cands:
                    return self.policy.choose(cands, rr, self.avg_request_tokens)
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

    def _begin(self, d: Decision, rr: RouteRequest, retry: bool, caches: bool = True) -> _Flight:
        rep = d.replica
        share = d.matched_chars / max(len(rr.text), 1)
        cached = rr.prompt_tokens * share
        tokens = rr.prompt_tokens - cached + rr.output_tokens
        rep.inflight += 1
        rep.inflight_tokens += tokens
        rep.routed += 1
        rep.est_prompt_tokens += rr.prompt_tokens
        rep.est_cached_tokens += cached
        if caches:  # the replica will hold this prompt in its prefix cache
            rep.tree.insert(rr.text, self.clock())
        self.avg_request_tokens += 0.05 * (rr.prompt_tokens + rr.output_tokens - self.avg_request_tokens)
        self.metrics.routed.labels(rep.name, "retry" if retry else d.reason).inc()
        self.metrics.est_prompt.labels(rep.name).inc(rr.prompt_tokens)
        self.metrics.est_cached.labels(rep.name).inc(cached)
        return _Flight(rep, tokens)

    def _end(self, f: _Flight) -> None:
        if not f.done:
            f.done = True
            rep = f.replica
            rep.inflight -= 1
            rep.inflight_tokens = max(0.0, rep.inflight_tokens - f.tokens) if rep.inflight else 0.0
            if rep.draining and not rep.inflight:
                self.notify()  # a drain waits for this

    def _learn(self, rr: RouteRequest, content: bytes) -> None:
        """Refine characters per token from a replica's own count of the prompt."""
        try:
            usage = json.loads(content).get("usage") or {}
            tokens = int(usage.get("prompt_tokens") or 0)
            if not tokens:  # Anthropic's accounting: uncached + read from the cache
                tokens = int(usage.get("input_tokens") or 0) + int(usage.get("cache_read_input_tokens") or 0)
        except (ValueError, AttributeError, TypeError):
            return
        if tokens > 0 and len(rr.text) > 0:
            ratio = min(max(len(rr.text) / tokens, 1.0), 16.0)
            self.chars_per_token += 0.1 * (ratio - self.chars_per_token)

    # ------------------------------------------------------------ proxying
    async def forward(self, path: str, raw: bytes, body: dict[str, Any], headers: dict[str, str]) -> Response:
        """Send one POST to a replica; the answer, or an error once retries are spent."""
        cfg = self.config
        if self.draining:
            raise RouterError(503, "the router is shutting down; retry shortly", "draining", cfg.retry_after)
        if self.pending >= cfg.max_pending:
            raise RouterError(429, f"the router holds {self.pending} requests, its limit (--max-pending); "
                              "retry later", "overloaded", cfg.retry_after)
        rr = self.route_request(path, body)
        stream = bool(body.get("stream"))
        send_headers = {k: v for k, v in headers.items() if k.lower() not in _HOP_HEADERS}
        send_headers["accept-encoding"] = "identity"  # bytes pass through as they come: never compressed
        self.pending += 1
        handed_off = False
        # NOTE: the replicas themselves, not their ids: a restarted replica is a new object, and an
        # id could be reused once the old one is freed.
        tried: set[Replica] = set()
        last: tuple[int, str, str] | None = None  # status, why, replica
        # Failover (OpenAI chat/completions): what the answer has produced so far, so that another
        # replica can continue it. Without continuations allowed it would only cost.
        answer = AnswerProgress(body, stream) if cfg.max_retries > 0 and supports_failover(path, body) else None
        retries = 0
        continuing = False  # this attempt continues an answer a failed replica had begun (whole answers)
        try:
            while True:
                # After a 429 only replicas routable right now are worth trying: waiting would not help.
                try:
                    d = await self.pick(rr, tried, wait=last is None or last[0] not in _FULL)
                except RouterError:
                    if continuing:
                        self.metrics.continuations.labels("failed").inc()
                    raise
                rep = d.replica
                tried.add(rep)
                flight = self._begin(d, rr, retry=bool(retries or continuing), caches=path in _GENERATING)
                use = answer if answer is not None and rep.continues else None
                outcome = await self._attempt(flight, path, raw if use is None else use.request_body(), send_headers,
                                              stream, rr, use, tried)
                if isinstance(outcome, Response):
                    if continuing:
                        self.metrics.continuations.labels("ok").inc()
                    handed_off = stream and outcome.status_code == 200
                    return outcome
                last = outcome
                if continuing:
                    self.metrics.continuations.labels("failed").inc()
                if use is not None and use.started:
                    # A whole answer that had begun (its progress is recorded): continue it elsewhere.
                    if use.continuations >= cfg.max_retries:
                        self.metrics.continuations.labels("exhausted").inc()
                        log.info("answer failed on %s part-way (%s); no continuation left", rep.name, outcome[1])
                        break
                    use.continuations += 1
                    continuing = True
                    log.info("answer failed on %s part-way (%s); continuing it on another replica", rep.name,
                             outcome[1])
                    continue
                self.metrics.retries.labels(rep.name, str(outcome[0]) if outcome[0] else "transport").inc()
                retries += 1
                log.info("request failed on %s before its answer began (%s)%s", rep.name, outcome[1],
                         "; retrying on another replica" if retries <= cfg.max_retries else "")
                if retries > cfg.max_retries:
                    break
        except RouterError as e:
            if last is None:
                raise
            log.info("no replica left to retry on: %s", e)
        finally:
            if not handed_off:
                self.pending -= 1
        assert last is not None
        status, why, name = last
        if status in _FULL:
            raise RouterError(429, "every replica tried is at capacity; retry later", "overloaded", cfg.retry_after,
                              anthropic_status=529)
        raise RouterError(502 if status else 503, f"the request failed on {len(tried)} replica(s), last on {name}: "
                          f"{why}; retry shortly", "replica_failed", cfg.retry_after)

    async def _attempt(self, f: _Flight, path: str, raw: bytes, headers: dict[str, str], stream: bool,
                       rr: RouteRequest, answer: AnswerProgress | None = None,
                       tried: set[Replica] | None = None) -> Response | tuple[int, str, str]:
        """One try on one replica: a Response to give the client, or (status, why, replica) to retry.
        ``answer``: under failover (the body asks the replica for resume points)."""
        assert self._client is not None
        rep = f.replica
        resp: httpx.Response | None = None
        handed_off = False
        try:
            req = self._client.build_request("POST", rep.url + path, content=raw, headers=headers)
            resp = await self._client.send(req, stream=True)
            if resp.status_code in _RETRYABLE:
                text = (await resp.aread()).decode(errors="replace")[:300]
                # A full replica (429, or 503 with tripod's "overloaded" code under
                # --overload-status 503) is healthy: try another, but keep routing to it.
                full = resp.status_code in _FULL or '"overloaded"' in text
                if not full:
                    rep.failures += 1
                    # NOTE: a 503 (draining, engine dead) asks for nothing more: out of rotation now.
                    self.record_failure(rep, f"answered {resp.status_code}", fatal=resp.status_code == 503)
                return (resp.status_code if resp.status_code in _FULL else 429) if full else resp.status_code, \
                    f"{rep.name} answered {resp.status_code}: {text}", rep.name
            back = {k: v for k, v in resp.headers.items() if k.lower() in _PASS_BACK}
            back["x-tripod-replica"] = rep.name
            if not stream or resp.status_code != 200:
                if answer is not None and resp.status_code == 200 \
                        and resp.headers.get("content-type", "").startswith("text/event-stream"):
                    content = await self._progress(answer, resp)  # a whole answer under failover
                    back["content-type"] = "application/json"
                    back.pop("cache-control", None)  # (the progress stream's, not the answer's)
                else:
                    content = await resp.aread()
                if resp.status_code == 200:
                    self.record_success(rep)
                    self._learn(rr, content)
                return Response(content, status_code=resp.status_code, headers=back)
            it = resp.aiter_raw()
            first = b""
            while not first:
                first = await anext(it)  # StopAsyncIteration: closed before any byte
            self.record_success(rep)
            upstream = resp
            handed_off = True  # the stream owns the flight and the upstream response now
            if answer is not None:
                run = _Run(f, resp, answer, path, headers, rr, tried if tried is not None else {rep})
                return ClosingStream(self._relay_failover(run, it, first), headers=back,
                                     on_close=lambda: self._close_run(run))
            return ClosingStream(self._relay(f, it, first, is_anthropic(path)), headers=back,
                                  on_close=lambda: self._close_stream(f, upstream))
        except (httpx.HTTPError, StopAsyncIteration, Failed, TimeoutError) as e:
            rep.failures += 1
            self.record_failure(rep, f"{type(e).__name__}: {e}", fatal=isinstance(e, httpx.ConnectError))
            return 0, f"{type(e).__name__} talking to {rep.name}: {e}", rep.name
        finally:
            if not handed_off:
                self._end(f)
                if resp is not None:
                    await resp.aclose()

    async def _relay(self, f: _Flight, it: AsyncIterator[bytes], first: bytes,
                     anthropic: bool = False) -> AsyncIterator[bytes]:
        rep = f.replica
        yield first
        sent = 1
        try:
            async for chunk in it:
                yield chunk
                sent += 1
        except httpx.HTTPError as e:
            rep.failures += 1
            self.metrics.stream_failures.labels(rep.name).inc()
            self.record_failure(rep, f"stream cut: {type(e).__name__}")
            log.warning("stream from %s cut after %d chunks: %s", rep.name, sent, e)
            yield self._stream_error(rep, type(e).__name__, None, anthropic)

    # ------------------------------------------------------------ failover
    async def _next(self, it: AsyncIterator[bytes]) -> bytes:
        """The next bytes of an answer under way; a replica silent past the stall timeout, or a
        stream that ends before ``[DONE]``, has failed."""
        try:
            return await asyncio.wait_for(anext(it), self.config.stall_timeout)
        except StopAsyncIteration:
            raise Failed("the answer ended before it was complete") from None
        except TimeoutError:
            raise Failed(f"the answer stalled (nothing for {self.config.stall_timeout:g} s)") from None

    async def _progress(self, answer: AnswerProgress, resp: httpx.Response) -> bytes:
        """Read a whole answer's progress stream to its result (the answer's bytes)."""
        split = SSESplitter()
        it = resp.aiter_raw()
        while True:
            for raw in split.feed(await self._next(it)):
                out = answer.progress(raw)
                if out is not None:
                    return out

    async def _relay_failover(self, run: _Run, it: AsyncIterator[bytes], first: bytes) -> AsyncIterator[bytes]:
        """Relay a stream event by event (each delta's chunks together, resume points removed);
        when its replica fails, continue it on another one, the client none the wiser."""
        answer = run.answer
        chunk = first
        while True:
            split = SSESplitter()
            try:
                while True:
                    for raw in split.feed(chunk):
                        step = answer.relay(raw)
                        if step.send:
                            yield step.send
                        if step.done:
                            return
                    chunk = await self._next(it)
            except (httpx.HTTPError, Failed) as e:
                why = f"{type(e).__name__}: {e}" if isinstance(e, httpx.HTTPError) else str(e)
            rep = run.flight.replica
            answer.abandon_held()
            rep.failures += 1
            self.metrics.stream_failures.labels(rep.name).inc()
            self.record_failure(rep, f"stream failed: {why}")
            log.warning("stream from %s failed mid-answer (%s)", rep.name, why)
            self._end(run.flight)
            await run.resp.aclose()  # the replica (if alive) aborts the request and frees its KV
            t0 = self.clock()
            nxt = await self._continue(run)
            if nxt is None:
                yield self._stream_error(rep, why, answer, anthropic=False)
                return
            self.metrics.continuation_seconds.observe(self.clock() - t0)
            it, chunk = nxt

    async def _continue(self, run: _Run) -> tuple[AsyncIterator[bytes], bytes] | None:
        """Send the continuation of ``run``'s answer to another replica (within the budget); its
        stream and first bytes, or None when no continuation could take over."""
        assert self._client is not None
        cfg, answer = self.config, run.answer
        while answer.continuations < cfg.max_retries:
            answer.continuations += 1
            try:
                d = await self.pick(run.rr, run.tried, wait=True)
            except RouterError as e:
                self.metrics.continuations.labels("failed").inc()
                log.warning("no replica to continue the answer on: %s", e)
                return None
            rep = d.replica
            run.tried.add(rep)
            if not rep.continues:
                self.metrics.continuations.labels("failed").inc()
                continue
            f = run.flight = self._begin(d, run.rr, retry=True)
            resp: httpx.Response | None = None
            took_over = False
            try:
                req = self._client.build_request("POST", rep.url + run.path, content=answer.request_body(),
                                                 headers=run.headers)
                resp = await self._client.send(req, stream=True)
                if resp.status_code == 200:
                    it = resp.aiter_raw()
                    first = b""
                    while not first:
                        first = await anext(it)
                    run.resp, took_over = resp, True
                    self.record_success(rep)
                    self.metrics.continuations.labels("ok").inc()
                    log.info("answer continued on %s (continuation %d)", rep.name, answer.continuations)
                    return it, first
                text = (await resp.aread()).decode(errors="replace")[:300]
                self.metrics.continuations.labels("failed").inc()
                log.warning("continuation refused by %s: %d %s", rep.name, resp.status_code, text)
                if resp.status_code not in _RETRYABLE:
                    return None  # the request itself is refused: another replica would refuse it too
                if resp.status_code not in _FULL:
                    self.record_failure(rep, f"answered {resp.status_code}", fatal=resp.status_code == 503)
            except (httpx.HTTPError, StopAsyncIteration) as e:
                self.metrics.continuations.labels("failed").inc()
                rep.failures += 1
                self.record_failure(rep, f"{type(e).__name__}: {e}", fatal=isinstance(e, httpx.ConnectError))
            finally:
                if not took_over:
                    self._end(f)
                    if resp is not None:
                        await resp.aclose()
        self.metrics.continuations.labels("exhausted").inc()
        return None

    def _stream_error(self, rep: Replica, why: str, answer: AnswerProgress | None, anthropic: bool) -> bytes:
        """The error event that ends a stream cut after it had started (not continued)."""
        if answer is None:
            tail = "It was not retried elsewhere, so no part of it is duplicated: send the request again."
        elif answer.continuations >= self.config.max_retries:
            tail = (f"It could not be continued elsewhere ({answer.continuations} continuation(s) tried, "
                    "--max-retries): send the request again.")
        else:
            tail = "No replica could continue it: send the request again."
        msg = (f"the replica serving this stream ({rep.name}) failed after the answer had started ({why}); "
               f"the answer is incomplete. {tail}")
        if anthropic:  # Anthropic's stream error event
            err = {"type": "error", "error": {"type": "api_error", "message": msg}}
            return b"event: error\ndata: " + json.dumps(err).encode() + b"\n\n"
        body = {"error": {"message": msg, "type": "server_error", "param": None, "code": "replica_failed"}}
        return b"data: " + json.dumps(body).encode() + b"\n\n"

    def _close_run(self, run: _Run) -> None:
        self._close_stream(run.flight, run.resp)

    def _close_stream(self, f: _Flight, resp: httpx.Response) -> None:
        self._end(f)
        self.pending -= 1
        # NOTE: closing the upstream response drops the connection, which the replica sees as the
        # client leaving: it aborts the request and frees its KV.
        task = asyncio.get_running_loop().create_task(resp.aclose())
        self._closing.add(task)  # NOTE: held until done: the loop keeps only weak references to tasks
        task.add_done_callback(self._closing.discard)


_LOAD_NAMES = {
    "running": ("tripod:num_requests_running", "vllm:num_requests_running", "sglang:num_running_reqs"),
    "waiting": ("tripod:num_requests_waiting", "vllm:num_requests_waiting", "sglang:num_queue_reqs"),
}


def parse_load(text: str) -> tuple[int, int]:
    """Running and waiting sequences from a Prometheus text page (tripod's, vLLM's or SGLang's names)."""
    found = {"running": 0.0, "waiting": 0.0}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        for key, names in _LOAD_NAMES.items():
            if name in names:
                try:
                    found[key] += float(line.rsplit(" ", 1)[1])
                except (IndexError, ValueError):
                    pass
    return int(found["running"]), int(found["waiting"])
