"""Proxying one request: its bytes to the replica the policy picks, retried elsewhere on failures
before the first byte of an answer, and the answer back unchanged (a stream chunk by chunk,
never buffered).

An OpenAI chat/completions answer from tripod replicas that fails after it has begun is continued
on another replica (``router/relay.py``): a stream simply goes on, a whole answer is completed
where the first replica stopped. Elsewhere (other APIs, other servers, continuations spent) a
stream cut after its first chunk ends with an error event, never a silent second answer.
"""

from __future__ import annotations

import logging
import os
import ssl
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import httpx
from starlette.responses import Response

from tripod import tracing
from tripod.asgi import ClosingStream
from tripod.protocol import pd
from tripod.router.core import RouterCore
from tripod.router.errors import FULL, RETRYABLE, RouterError, stream_error
from tripod.router.failover import AnswerProgress, Failed, supports_failover
from tripod.router.pd import Disaggregator
from tripod.router.policy import RouteRequest
from tripod.router.prompt import is_anthropic
from tripod.router.relay import FailoverRelay, Run
from tripod.router.replica import Flight, Replica


def replica_ssl_context(ca_file: str | None) -> ssl.SSLContext | bool:
    """How the router verifies replicas it reaches over ``https://``: against ``ca_file`` (a PEM
    bundle; ``--ssl-ca``) when given, else the default store (True). An unreadable or invalid
    bundle raises ``OSError``/``ssl.SSLError`` (start-up refuses it)."""
    return ssl.create_default_context(cafile=ca_file) if ca_file else True


def trust_replica_ca(ca_file: str | None) -> None:
    """Make the router's HTTP clients verify replicas against ``ca_file``: checked now, then named
    in ``SSL_CERT_FILE``, which httpx reads when the router opens its clients (``Router.start``).
    NOTE: process-wide, which a router process is; once the clients take
    ``verify=replica_ssl_context(...)`` themselves this is no longer needed."""
    if ca_file:
        replica_ssl_context(ca_file)
        os.environ["SSL_CERT_FILE"] = ca_file

log = logging.getLogger("tripod.router")

# Requests whose prompt the replica caches (others, like count_tokens, only use it for the choice).
_GENERATING = {"/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses"}
_HOP_HEADERS = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "upgrade",
                "proxy-authorization", "proxy-connection", "accept-encoding"}
_PASS_BACK = ("content-type", "retry-after", "x-request-id", "cache-control")

Outcome = Response | tuple[int, str, str]  # an answer for the client, or (status, why, replica) to retry


@dataclass(slots=True)
class _Call:
    """One request as the proxy sends it: the same for every attempt."""

    path: str
    raw: bytes
    headers: dict[str, str]
    stream: bool
    rr: RouteRequest
    answer: AnswerProgress | None  # under failover: what the answer has produced so far


class Proxy:
    """Forwards requests for one router (its replicas, policy and accounting), handing a new
    prompt's prefill to ``pd`` first when it wants it."""

    def __init__(self, router: RouterCore, pd: Disaggregator) -> None:
        self.router = router
        self.pd = pd
        self.failover = FailoverRelay(router)

    async def forward(self, path: str, raw: bytes, body: dict[str, Any], headers: dict[str, str]) -> Response:
        """Send one POST to a replica; the answer, or an error once retries are spent."""
        r, cfg = self.router, self.router.config
        if r.draining:
            raise RouterError(503, "the router is shutting down; retry shortly", "draining", cfg.retry_after)
        if r.pending >= cfg.max_pending:
            raise RouterError(429, f"the router holds {r.pending} requests, its limit (--max-pending); "
                              "retry later", "overloaded", cfg.retry_after)
        stream = bool(body.get("stream"))
        send_headers = {k: v for k, v in headers.items() if k.lower() not in _HOP_HEADERS}
        send_headers["accept-encoding"] = "identity"  # bytes pass through as they come: never compressed
        # Failover (OpenAI chat/completions): what the answer has produced so far, so that another
        # replica can continue it. Without continuations allowed it would only cost.
        answer = AnswerProgress(body, stream) if cfg.max_retries > 0 and supports_failover(path, body) else None
        call = _Call(path, raw, send_headers, stream, r.route_request(path, body), answer)
        r.pending += 1
        handed_off = False
        try:
            resp = await self._tries(call)
            handed_off = stream and resp.status_code == 200  # the stream's close ends the request
            return resp
        finally:
            if not handed_off:
                r.pending -= 1

    async def _tries(self, call: _Call) -> Response:
        """Attempts on replica after replica: retries before an answer began, continuations of a
        whole answer that had begun; the router's error once both budgets are spent."""
        r, cfg = self.router, self.router.config
        # NOTE: the replicas themselves, not their ids: a restarted replica is a new object, and an
        # id could be reused once the old one is freed.
        tried: set[Replica] = set()
        last: tuple[int, str, str] | None = None  # status, why, replica
        retries = 0
        continuing = False  # this attempt continues an answer a failed replica had begun (whole answers)
        try:
            while True:
                # After a 429 only replicas routable right now are worth trying: waiting would not help.
                try:
                    d = await r.pick(call.rr, tried, wait=last is None or last[0] not in FULL)
                except RouterError:
                    if continuing:
                        r.metrics.continuations.labels("failed").inc()
                    raise
                rep = d.replica
                tried.add(rep)
                if last is None and not continuing and self.pd.wants(call.path, d, call.rr):
                    # NOTE: before the attempt begins: the decode replica then finds the prompt cached.
                    transfer = await self.pd.prefill(call.path, call.raw, call.headers, rep)
                    call.headers = {**call.headers, pd.TRANSFER_HEADER: transfer}  # (unknown to other replicas)
                flight = r.begin(d, call.rr, retry=bool(retries or continuing), caches=call.path in _GENERATING,
                                 continuation=continuing)
                use = call.answer if call.answer is not None and rep.continues else None
                outcome = await self._attempt(flight, call, use, tried)
                if continuing:
                    r.metrics.continuations.labels("ok" if isinstance(outcome, Response) else "failed").inc()
                if isinstance(outcome, Response):
                    return outcome
                last = outcome
                if use is not None and use.started:
                    # A whole answer that had begun (its progress is recorded): continue it elsewhere.
                    continuing = self._may_continue(use, rep, outcome[1])
                    if not continuing:
                        break
                    continue
                r.metrics.retries.labels(rep.name, str(outcome[0]) if outcome[0] else "transport").inc()
                retries += 1
                log.info("request failed on %s before its answer began (%s)%s", rep.name, outcome[1],
                         "; retrying on another replica" if retries <= cfg.max_retries else "")
                if retries > cfg.max_retries:
                    break
        except RouterError as e:
            if last is None:
                raise
            log.info("no replica left to retry on: %s", e)
        assert last is not None
        raise self._failed(last, len(tried))

    def _may_continue(self, answer: AnswerProgress, rep: Replica, why: str) -> bool:
        """Whether a whole answer that failed part-way on ``rep`` may go on elsewhere (counted)."""
        if answer.continuations >= self.router.config.max_retries:
            self.router.metrics.continuations.labels("exhausted").inc()
            log.info("answer failed on %s part-way (%s); no continuation left", rep.name, why)
            return False
        answer.continuations += 1
        log.info("answer failed on %s part-way (%s); continuing it on another replica", rep.name, why)
        return True

    def _failed(self, last: tuple[int, str, str], tried: int) -> RouterError:
        """The router's answer once no attempt succeeded: 429 when the replicas were full."""
        cfg = self.router.config
        status, why, name = last
        if status in FULL:
            return RouterError(429, "every replica tried is at capacity; retry later", "overloaded",
                               cfg.retry_after, anthropic_status=529)
        return RouterError(502 if status else 503, f"the request failed on {tried} replica(s), last on {name}: "
                           f"{why}; retry shortly", "replica_failed", cfg.retry_after)

    async def _attempt(self, f: Flight, call: _Call, answer: AnswerProgress | None,
                       tried: set[Replica]) -> Outcome:
        """One try on one replica: a Response to give the client, or (status, why, replica) to retry.
        ``answer``: under failover (the body asks the replica for resume points)."""
        r = self.router
        assert r.client is not None
        rep = f.replica
        resp: httpx.Response | None = None
        handed_off = False
        try:
            content = call.raw if answer is None else answer.request_body()
            headers = call.headers if f.span is None else tracing.inject(call.headers, f.span)
            req = r.client.build_request("POST", rep.url + call.path, content=content, headers=headers)
            resp = await r.client.send(req, stream=True)
            back = {k: v for k, v in resp.headers.items() if k.lower() in _PASS_BACK}
            back["x-tripod-replica"] = rep.name
            if resp.status_code in RETRYABLE and not await _tenant_over_limit(resp):
                f.failure = f"answered {resp.status_code}"
                return await self._refused(rep, resp)
            if not call.stream or resp.status_code != 200:
                return await self._whole(rep, resp, back, call, answer)
            it = resp.aiter_raw()
            first = b""
            while not first:
                first = await anext(it)  # StopAsyncIteration: closed before any byte
            r.record_success(rep)
            handed_off = True  # the stream owns the flight and the upstream response now
            return self._stream(f, resp, it, first, back, call, answer, tried)
        except (httpx.HTTPError, StopAsyncIteration, Failed, TimeoutError) as e:
            f.failure = f"{type(e).__name__}: {e}"
            rep.failures += 1
            r.record_failure(rep, f"{type(e).__name__}: {e}", fatal=isinstance(e, httpx.ConnectError))
            return 0, f"{type(e).__name__} talking to {rep.name}: {e}", rep.name
        finally:
            if not handed_off:
                r.end(f)
                if resp is not None:
                    await resp.aclose()

    async def _refused(self, rep: Replica, resp: httpx.Response) -> tuple[int, str, str]:
        """A replica's retryable status: why, for the retry (429 for a replica at capacity)."""
        text = (await resp.aread()).decode(errors="replace")[:300]
        # A full replica (429, or 503 with tripod's "overloaded" code under
        # --overload-status 503) is healthy: try another, but keep routing to it.
        full = resp.status_code in FULL or '"overloaded"' in text
        if not full:
            rep.failures += 1
            # NOTE: a 503 (draining, engine dead) asks for nothing more: out of rotation now.
            self.router.record_failure(rep, f"answered {resp.status_code}", fatal=resp.status_code == 503)
        status = (resp.status_code if resp.status_code in FULL else 429) if full else resp.status_code
        return status, f"{rep.name} answered {resp.status_code}: {text}", rep.name

    async def _whole(self, rep: Replica, resp: httpx.Response, back: dict[str, str], call: _Call,
                     answer: AnswerProgress | None) -> Response:
        """A whole answer (or a stream's error status), read and passed back."""
        if answer is not None and resp.status_code == 200 \
                and resp.headers.get("content-type", "").startswith("text/event-stream"):
            content = await self.failover.whole(answer, resp)  # a whole answer under failover
            back["content-type"] = "application/json"
            back.pop("cache-control", None)  # (the progress stream's, not the answer's)
        else:
            content = await resp.aread()
        if resp.status_code == 200:
            self.router.record_success(rep)
            self.router.learn(call.rr, content)
            if call.path == "/v1/responses":
                self.router.affinity.learn_whole(content, rep.name)
        return Response(content, status_code=resp.status_code, headers=back)

    def _stream(self, f: Flight, resp: httpx.Response, it: AsyncIterator[bytes], first: bytes,
                back: dict[str, str], call: _Call, answer: AnswerProgress | None,
                tried: set[Replica]) -> Response:
        """A stream that has begun, handed to the client; its close ends the flight and the request."""
        r = self.router
        if answer is not None:
            run = Run(f, resp, answer, call.path, call.headers, call.rr, tried)
            # NOTE: read at close: a continuation replaces the run's flight and upstream response.
            stream = ClosingStream(self.failover.relay(run, it, first), headers=back,
                                   on_close=lambda: r.finish_stream(run.flight, run.resp))
            stream.answer = answer  # type: ignore[attr-defined]  # its output count (router/tenant_limits.py)
            return stream
        watch = r.affinity.stream_watcher(f.replica.name) if call.path == "/v1/responses" else None
        return ClosingStream(self._relay(f, it, first, is_anthropic(call.path), watch), headers=back,
                             on_close=lambda: r.finish_stream(f, resp))

    async def _relay(self, f: Flight, it: AsyncIterator[bytes], first: bytes, anthropic: bool = False,
                     watch: Callable[[bytes], bool] | None = None) -> AsyncIterator[bytes]:
        """A stream passed through chunk by chunk; a cut ends it with an error event. ``watch``:
        fed the chunks until it has seen what it looks for (a response's id: router/affinity.py)."""
        r, rep = self.router, f.replica
        if watch is not None and watch(first):
            watch = None
        yield first
        sent = 1
        try:
            async for chunk in it:
                if watch is not None and watch(chunk):
                    watch = None
                yield chunk
                sent += 1
        except httpx.HTTPError as e:
            rep.failures += 1
            r.metrics.stream_failures.labels(rep.name).inc()
            r.record_failure(rep, f"stream cut: {type(e).__name__}")
            log.warning("stream from %s cut after %d chunks: %s", rep.name, sent, e)
            yield stream_error(rep.name, type(e).__name__, anthropic)


async def _tenant_over_limit(resp: httpx.Response) -> bool:
    """A replica's 429 for the caller's tenant limit (``rate_limit_exceeded``): the client's answer,
    as is (its Retry-After and the limit named), not a full replica to retry elsewhere."""
    if resp.status_code != 429:
        return False
    return b'"rate_limit_exceeded"' in await resp.aread()
