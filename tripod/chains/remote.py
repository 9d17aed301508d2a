"""Calling a chainlet that runs elsewhere: over HTTP to one of its replicas.

A ``ReplicaSource`` says which replicas of each chainlet are routable now (the server of the chain
knows it from its supervisors; a replica asks the server, every ``refresh_s`` and whenever a call
finds none). ``RemoteHandle`` picks the replica with the fewest calls in flight from this process
(not one that just failed, while another is there), POSTs the arguments to its ``/run`` and turns
the answer back into a typed value. A lost connection, a refused one, a 5xx or a 429 is retryable
(``Handle`` retries it); a 4xx is not. Cancelling a call closes its connection: the replica sees
its caller leave and cancels the work, and so on down the chain.

Wire format (``tripod.protocol.chains``): ``POST /run`` with a ``ChainCall`` (the arguments by
name as a JSON object); the answer is the return value as JSON, or for a streaming chainlet
``text/event-stream`` with one ``data:`` line of JSON per item, ``event: error`` (an ``ErrorBody``)
if it fails after it started, and ``event: end``. Errors are ``ErrorBody`` JSON with the status of
the failure.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx

from tripod import tracing
from tripod.chains.core import Dependency
from tripod.chains.errors import ChainletError
from tripod.chains.llm_client import ClientPool
from tripod.chains.metrics import ChainMetrics
from tripod.chains.runtime import Handle
from tripod.protocol.chains import (
    EVENT_END,
    EVENT_ERROR,
    ChainCall,
    decode_value,
    encode_call,
    sse_events,
)

log = logging.getLogger("tripod.chains")

UNAVAILABLE_WAIT_S = 30.0  # longest wait, within one attempt, for a replica to become routable
FAILED_AVOID_S = 2.0  # a replica that just failed is not picked while another one is routable


class ReplicaSource:
    """The routable replicas (base URLs) of each chainlet."""

    def urls(self, chainlet: str) -> list[str]:
        raise NotImplementedError

    async def wait(self, chainlet: str, timeout: float, avoid: frozenset[str] = frozenset()) -> list[str]:
        """The routable replicas, waiting (up to ``timeout``) for one that is not in ``avoid``."""
        raise NotImplementedError

    def failed(self, chainlet: str, url: str) -> None:
        """A call to ``url`` failed at the transport level (it may be gone)."""


class StaticSource(ReplicaSource):
    """Fixed URLs (tests, benchmarks)."""

    def __init__(self, urls: dict[str, list[str]]) -> None:
        self._urls = urls

    def urls(self, chainlet: str) -> list[str]:
        return list(self._urls.get(chainlet, []))

    async def wait(self, chainlet: str, timeout: float, avoid: frozenset[str] = frozenset()) -> list[str]:
        return self.urls(chainlet)


class PollingSource(ReplicaSource):
    """Asks ``fetch()`` (the chain server's ``/chain/replicas``) every ``refresh_s``, and at once
    when a chainlet has no routable replica or one failed."""

    def __init__(self, fetch: Callable[[], Awaitable[dict[str, list[str]]]], refresh_s: float = 0.5) -> None:
        self._fetch = fetch
        self.refresh_s = refresh_s
        self._urls: dict[str, list[str]] = {}
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._fresh: asyncio.Event | None = None

    def _ensure(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is not loop or self._task is None or self._task.done():
            self._loop = loop
            self._wake = asyncio.Event()
            self._fresh = asyncio.Event()
            self._task = loop.create_task(self._poll())

    async def _poll(self) -> None:
        assert self._wake is not None and self._fresh is not None
        while True:
            try:
                got = await self._fetch()
                self._urls = {k: list(v) for k, v in got.items()}
            except Exception as e:  # the server restarting: keep what we knew
                log.debug("could not refresh the replica list: %s", e)
            fresh, self._fresh = self._fresh, asyncio.Event()
            fresh.set()
            try:
                await asyncio.wait_for(self._wake.wait(), self.refresh_s)
            except TimeoutError:
                pass
            self._wake.clear()

    def urls(self, chainlet: str) -> list[str]:
        self._ensure()
        return list(self._urls.get(chainlet, []))

    async def refresh(self) -> None:
        self._ensure()
        assert self._wake is not None and self._fresh is not None
        fresh = self._fresh
        self._wake.set()
        await fresh.wait()

    async def wait(self, chainlet: str, timeout: float, avoid: frozenset[str] = frozenset()) -> list[str]:
        deadline = time.monotonic() + timeout
        urls = self.urls(chainlet)
        while not set(urls) - avoid and time.monotonic() < deadline:
            try:
                await asyncio.wait_for(self.refresh(), max(0.01, deadline - time.monotonic()))
            except TimeoutError:
                break
            urls = self.urls(chainlet)
            if not set(urls) - avoid:
                # NOTE: the server learns of new replicas by probing them; ask again shortly (bounded).
                await asyncio.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
        return urls

    def failed(self, chainlet: str, url: str) -> None:
        if self._wake is not None:
            self._wake.set()


class RemoteHandle(Handle):
    """A dependency served by other processes (see the module doc)."""

    def __init__(self, dep: Dependency, caller: str, metrics: ChainMetrics, source: ReplicaSource,
                 clients: ClientPool) -> None:
        super().__init__(dep, caller, metrics)
        self.source = source
        self.clients = clients
        self._inflight: dict[str, int] = {}
        self._failed_at: dict[str, float] = {}
        self._rr = 0

    async def _pick(self) -> str:
        """A routable replica that did not fail in the last ``FAILED_AVOID_S``; waits (bounded) for one:
        a replica that died comes back under a new URL once it is restarted."""
        deadline = time.monotonic() + UNAVAILABLE_WAIT_S
        while True:
            now = time.monotonic()
            urls = self.source.urls(self.name)
            fresh = [u for u in urls if now - self._failed_at.get(u, -1e9) > FAILED_AVOID_S]
            if fresh:
                break
            if now >= deadline:
                raise ChainletError(self.name, "no replica is running (all starting, restarting or failing)",
                                    code="unavailable", status=503, retryable=True)
            await self.source.wait(self.name, min(0.25, deadline - now), frozenset(urls))
        self._rr += 1
        # Fewest calls in flight from here; ties in turn.
        return min(fresh, key=lambda u: (self._inflight.get(u, 0), (fresh.index(u) - self._rr) % len(fresh)))

    def _lost(self, url: str, e: httpx.HTTPError) -> ChainletError:
        self._failed_at[url] = time.monotonic()
        self.source.failed(self.name, url)
        what = "refused the connection" if isinstance(e, httpx.ConnectError) else "was lost during the call"
        return ChainletError(self.name, f"its replica at {url} {what} ({type(e).__name__})", code="unavailable",
                             status=503, retryable=True)

    def _span(self, url: str) -> Any:
        """(Tracing on) the hop's span, a child of the current one (the caller's call)."""
        return tracing.start_span("chains.call", kind="client", attributes={
            "tripod.component": "chains", "tripod.caller": self.caller, "tripod.chainlet": self.name,
            "server.address": url})

    async def _once(self, call: ChainCall) -> Any:
        url = await self._pick()
        self._inflight[url] = self._inflight.get(url, 0) + 1
        headers = {"content-type": "application/json"}
        span = self._span(url) if tracing.ACTIVE else None
        error: str | None = None
        try:
            r = await self.clients.get().post(url + "/run", content=encode_call(call),
                                              headers=headers if span is None else tracing.inject(headers, span))
        except httpx.HTTPError as e:
            error = type(e).__name__
            raise self._lost(url, e) from None
        finally:
            self._inflight[url] -= 1
            if span is not None:
                tracing.end(span, error=error)
        if r.status_code == 200:
            return decode_value(r.content)
        raise ChainletError.from_body(self.name, r.status_code, r.content)

    async def _open(self, call: ChainCall) -> AsyncIterator[Any]:  # type: ignore[override]
        url = await self._pick()
        client = self.clients.get()
        self._inflight[url] = self._inflight.get(url, 0) + 1
        headers = {"content-type": "application/json", "accept": "text/event-stream"}
        span = self._span(url) if tracing.ACTIVE else None
        try:
            req = client.build_request("POST", url + "/run", content=encode_call(call),
                                       headers=headers if span is None else tracing.inject(headers, span))
            try:
                resp = await client.send(req, stream=True)
            except httpx.HTTPError as e:
                raise self._lost(url, e) from None
            try:
                if resp.status_code != 200:
                    raise ChainletError.from_body(self.name, resp.status_code, await resp.aread())
                async for event, data in sse_events(resp.aiter_lines()):
                    if event == EVENT_END:
                        return
                    if event == EVENT_ERROR:
                        raise ChainletError.from_body(self.name, 500, data)
                    yield decode_value(data)
                raise ChainletError(self.name, f"its stream from {url} ended without its end event",
                                    code="unavailable", status=502, retryable=True)
            except httpx.HTTPError as e:
                raise self._lost(url, e) from None
            finally:
                await resp.aclose()  # unread: the connection drops and the replica cancels the call
        finally:
            self._inflight[url] -= 1
            if span is not None:
                tracing.end(span)
