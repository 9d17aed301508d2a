"""The failover relay: an OpenAI chat/completions answer from tripod replicas that fails after it
has begun goes on on another replica, the client none the wiser.

The replica reports resume points in its stream (``router/failover.py`` reads them and writes the
continuation request); this module moves the bytes: it relays a stream event by event, and when
its replica fails (an error, a stall, an end before ``[DONE]``) it sends the continuation to
another replica that continues answers, within ``--max-retries``. A whole (non-streamed) answer
under failover is read from the same progress stream (``whole``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx

from tripod import tracing
from tripod.router.core import RouterCore
from tripod.router.errors import FULL, RETRYABLE, RouterError, stream_error
from tripod.router.failover import AnswerProgress, Failed, SSESplitter
from tripod.router.policy import RouteRequest
from tripod.router.replica import Flight, Replica

log = logging.getLogger("tripod.router")


@dataclass(slots=True)
class Run:
    """A stream under failover: the attempt serving it now (a continuation replaces it), what it
    needs to continue elsewhere, and what its ``on_close`` must undo."""

    flight: Flight
    resp: httpx.Response
    answer: AnswerProgress
    path: str
    headers: dict[str, str]
    rr: RouteRequest
    tried: set[Replica]


class _Refused(Exception):
    """A replica refused the continuation itself (not a retryable status): others would too."""


class FailoverRelay:
    """Relays and continues answers under failover for one router (its replicas, its accounting)."""

    def __init__(self, router: RouterCore) -> None:
        self.router = router

    async def next(self, it: AsyncIterator[bytes]) -> bytes:
        """The next bytes of an answer under way; a replica silent past the stall timeout, or a
        stream that ends before ``[DONE]``, has failed."""
        stall = self.router.config.stall_timeout
        try:
            return await asyncio.wait_for(anext(it), stall)
        except StopAsyncIteration:
            raise Failed("the answer ended before it was complete") from None
        except TimeoutError:
            raise Failed(f"the answer stalled (nothing for {stall:g} s)") from None

    async def whole(self, answer: AnswerProgress, resp: httpx.Response) -> bytes:
        """Read a whole answer's progress stream to its result (the answer's bytes)."""
        split = SSESplitter()
        it = resp.aiter_raw()
        while True:
            for raw in split.feed(await self.next(it)):
                out = answer.progress(raw)
                if out is not None:
                    return out

    async def relay(self, run: Run, it: AsyncIterator[bytes], first: bytes) -> AsyncIterator[bytes]:
        """Relay a stream event by event (each delta's chunks together, resume points removed);
        when its replica fails, continue it on another one, the client none the wiser."""
        r, answer = self.router, run.answer
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
                    chunk = await self.next(it)
            except (httpx.HTTPError, Failed) as e:
                why = f"{type(e).__name__}: {e}" if isinstance(e, httpx.HTTPError) else str(e)
            rep = run.flight.replica
            answer.abandon_held()
            rep.failures += 1
            r.metrics.stream_failures.labels(rep.name).inc()
            r.record_failure(rep, f"stream failed: {why}")
            log.warning("stream from %s failed mid-answer (%s)", rep.name, why)
            run.flight.failure = f"stream failed: {why}"
            r.end(run.flight)
            await run.resp.aclose()  # the replica (if alive) aborts the request and frees its KV
            t0 = r.clock()
            nxt = await self._continue(run)
            if nxt is None:
                yield stream_error(rep.name, why, False, answer.continuations, r.config.max_retries)
                return
            r.metrics.continuation_seconds.observe(r.clock() - t0)
            it, chunk = nxt

    async def _continue(self, run: Run) -> tuple[AsyncIterator[bytes], bytes] | None:
        """Send the continuation of ``run``'s answer to another replica (within the budget); its
        stream and first bytes, or None when no continuation could take over."""
        r, answer = self.router, run.answer
        while answer.continuations < r.config.max_retries:
            answer.continuations += 1
            try:
                d = await r.pick(run.rr, run.tried, wait=True)
            except RouterError as e:
                r.metrics.continuations.labels("failed").inc()
                log.warning("no replica to continue the answer on: %s", e)
                return None
            rep = d.replica
            run.tried.add(rep)
            if not rep.continues:
                r.metrics.continuations.labels("failed").inc()
                continue
            run.flight = r.begin(d, run.rr, retry=True, continuation=True)
            try:
                took = await self._take_over(run)
            except _Refused:
                return None
            if took is not None:
                return took
        r.metrics.continuations.labels("exhausted").inc()
        return None

    async def _take_over(self, run: Run) -> tuple[AsyncIterator[bytes], bytes] | None:
        """Send the continuation to ``run.flight``'s replica: its stream and first bytes, or None
        (that replica failed: try another), or ``_Refused``."""
        r, f = self.router, run.flight
        rep = f.replica
        assert r.client is not None
        resp: httpx.Response | None = None
        took_over = False
        try:
            headers = run.headers if f.span is None else tracing.inject(run.headers, f.span)
            req = r.client.build_request("POST", rep.url + run.path, content=run.answer.request_body(),
                                         headers=headers)
            resp = await r.client.send(req, stream=True)
            if resp.status_code == 200:
                it = resp.aiter_raw()
                first = b""
                while not first:
                    first = await anext(it)
                run.resp, took_over = resp, True
                r.record_success(rep)
                r.metrics.continuations.labels("ok").inc()
                log.info("answer continued on %s (continuation %d)", rep.name, run.answer.continuations)
                return it, first
            text = (await resp.aread()).decode(errors="replace")[:300]
            f.failure = f"answered {resp.status_code}"
            r.metrics.continuations.labels("failed").inc()
            log.warning("continuation refused by %s: %d %s", rep.name, resp.status_code, text)
            if resp.status_code not in RETRYABLE:
                raise _Refused  # the request itself is refused: another replica would refuse it too
            if resp.status_code not in FULL:
                r.record_failure(rep, f"answered {resp.status_code}", fatal=resp.status_code == 503)
        except (httpx.HTTPError, StopAsyncIteration) as e:
            f.failure = f"{type(e).__name__}: {e}"
            r.metrics.continuations.labels("failed").inc()
            rep.failures += 1
            r.record_failure(rep, f"{type(e).__name__}: {e}", fatal=isinstance(e, httpx.ConnectError))
        finally:
            if not took_over:
                r.end(f)
                if resp is not None:
                    await resp.aclose()
        return None
