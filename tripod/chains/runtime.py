"""Calling chainlets: handles (what a dependency is at run time), retries, timeouts, and running a
chainlet's ``run`` at its boundary. Shared by ``run_local`` and the served replicas, so both
validate, retry and fail the same way. The chain context that gives out the handles (``Runtime``)
is ``tripod.chains.core``'s.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from tripod.chains.core import Chainlet, Dependency, signature
from tripod.chains.errors import ChainletError, LLMError
from tripod.chains.metrics import ChainMetrics
from tripod.chains.signature import Signature
from tripod.protocol.chains import ChainCall

MAX_BACKOFF_S = 5.0


# --------------------------------------------------------------------------- the callee's side
def _as_chainlet_error(name: str, e: Exception) -> ChainletError:
    """An exception out of ``name``'s ``run``, as the error its caller gets."""
    if isinstance(e, ChainletError):
        return e.within(name)  # one of its own dependencies failed
    if isinstance(e, LLMError):
        return ChainletError(name, str(e), code="llm_error", status=502 if e.retryable else 500,
                             retryable=e.retryable)
    if isinstance(e, TimeoutError):
        return ChainletError(name, f"TimeoutError: {e}", code="timeout", status=504, retryable=True)
    return ChainletError(name, f"{type(e).__name__}: {e}", code="chainlet_error", retryable=True)


def parse_args(sig: Signature, call: ChainCall | Any, metrics: ChainMetrics) -> dict[str, Any]:
    """The callee's side of a call: its arguments validated (a 400 ``ChainletError`` naming the
    field). ``call``: a ``ChainCall`` (in this process), or the parsed JSON body of one (served)."""
    try:
        return sig.parse_call(call) if isinstance(call, ChainCall) else sig.parse_args(call)
    except ChainletError:
        metrics.calls.labels(sig.name, "invalid").inc()
        raise


async def execute(instance: Chainlet, sig: Signature, args: dict[str, Any], metrics: ChainMetrics) -> Any:
    """Run ``instance.run(**args)`` (already validated); its answer as JSON-shaped data.
    Raises ``ChainletError`` naming the chainlet; cancellation passes through (the caller left)."""
    name = sig.name
    t0 = time.perf_counter()
    outcome = "error"
    metrics.inflight.labels(name).inc()
    try:
        try:
            if sig.is_async:
                result = await instance.run(**args)
            else:
                result = await asyncio.to_thread(instance.run, **args)
        except Exception as e:
            raise _as_chainlet_error(name, e) from e
        data = sig.dump_output(result)
        outcome = "ok"
        return data
    except asyncio.CancelledError:
        outcome = "cancelled"
        raise
    finally:
        metrics.inflight.labels(name).dec()
        metrics.calls.labels(name, outcome).inc()
        metrics.latency.labels(name).observe(time.perf_counter() - t0)


async def execute_stream(instance: Chainlet, sig: Signature, args: dict[str, Any],
                         metrics: ChainMetrics) -> AsyncIterator[Any]:
    """Iterate a streaming chainlet's ``run``; each item checked and JSON-shaped as it comes."""
    name = sig.name
    t0 = time.perf_counter()
    outcome = "error"
    metrics.inflight.labels(name).inc()
    gen: Any = instance.run(**args)
    try:
        while True:
            try:
                item = await anext(gen)
            except StopAsyncIteration:
                break
            except Exception as e:
                raise _as_chainlet_error(name, e) from e
            data = sig.dump_output(item)
            metrics.items.labels(name).inc()
            yield data
        outcome = "ok"
    except (asyncio.CancelledError, GeneratorExit):
        outcome = "cancelled"
        raise
    finally:
        try:
            await gen.aclose()
        finally:
            metrics.inflight.labels(name).dec()
            metrics.calls.labels(name, outcome).inc()
            metrics.latency.labels(name).observe(time.perf_counter() - t0)


# --------------------------------------------------------------------------- the caller's side
class Handle:
    """A dependency as its caller holds it: ``await handle.run(...)`` (or ``async for`` over it when
    the callee streams) with the callee's parameters. Each attempt is limited to ``timeout_s``
    (its work is cancelled past it); retryable failures are tried again up to ``retries`` times
    after a doubling backoff; the result is validated against the callee's return annotation."""

    def __init__(self, dep: Dependency, caller: str, metrics: ChainMetrics) -> None:
        self.dep = dep
        self.sig: Signature = signature(dep.cls)
        self.name = self.sig.name
        self.caller = caller
        self.metrics = metrics

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.caller} → {self.name}>"

    def run(self, *args: Any, **kwargs: Any) -> Any:
        call = self.sig.encode_call(args, kwargs)
        return self._stream(call) if self.sig.streaming else self._call(call)

    # transports implement these two
    async def _once(self, call: ChainCall) -> Any:
        """One attempt; the answer as JSON-shaped data, or ``ChainletError``."""
        raise NotImplementedError

    def _open(self, call: ChainCall) -> AsyncIterator[Any]:
        """One attempt at a stream: its items as JSON-shaped data."""
        raise NotImplementedError

    def _timeout_error(self) -> ChainletError:
        return ChainletError(self.name, f"timed out after {self.dep.timeout_s:g} s (timeout_s of {self.caller}'s "
                             "call); its work was cancelled", code="timeout", status=504, retryable=True)

    async def _backoff(self, attempt: int, err: ChainletError) -> None:
        self.metrics.retries.labels(self.caller, self.name, err.code).inc()
        await asyncio.sleep(min(self.dep.backoff_s * 2 ** attempt, MAX_BACKOFF_S))

    def _give_up(self, err: ChainletError, attempts: int) -> ChainletError:
        self.metrics.failures.labels(self.caller, self.name, err.code).inc()
        return err.after(attempts)

    async def _call(self, call: ChainCall) -> Any:
        t0 = time.perf_counter()
        attempt = 0
        try:
            while True:
                try:
                    if self.dep.timeout_s is None:
                        data = await self._once(call)
                    else:
                        async with asyncio.timeout(self.dep.timeout_s):
                            data = await self._once(call)
                    self.metrics.dep_calls.labels(self.caller, self.name, "ok").inc()
                    return self.sig.parse_output(data)
                except TimeoutError:
                    err = self._timeout_error()
                except ChainletError as e:
                    err = e
                self.metrics.dep_calls.labels(self.caller, self.name, err.code).inc()
                if not err.retryable or attempt >= self.dep.retries:
                    raise self._give_up(err, attempt + 1) from None
                await self._backoff(attempt, err)
                attempt += 1
        finally:
            self.metrics.dep_latency.labels(self.caller, self.name).observe(time.perf_counter() - t0)

    async def _stream(self, call: ChainCall) -> AsyncIterator[Any]:
        t0 = time.perf_counter()
        loop = asyncio.get_running_loop()
        attempt = 0
        try:
            while True:
                deadline = None if self.dep.timeout_s is None else loop.time() + self.dep.timeout_s
                it = self._open(call)
                started = False
                try:
                    try:
                        while True:
                            try:
                                if deadline is None:
                                    data = await anext(it)
                                else:
                                    async with asyncio.timeout_at(deadline):
                                        data = await anext(it)
                            except StopAsyncIteration:
                                break
                            started = True
                            yield self.sig.parse_output(data)
                        self.metrics.dep_calls.labels(self.caller, self.name, "ok").inc()
                        return
                    except TimeoutError:
                        err = self._timeout_error()
                    except ChainletError as e:
                        err = e
                finally:
                    await it.aclose()  # type: ignore[attr-defined]
                self.metrics.dep_calls.labels(self.caller, self.name, err.code).inc()
                if started:
                    # Items were delivered: a second attempt would deliver them again.
                    err = ChainletError(err.chainlet, f"the stream failed after it started: {err.detail}",
                                        code=err.code, status=err.status, retryable=False, path=err.path)
                if not err.retryable or attempt >= self.dep.retries:
                    raise self._give_up(err, attempt + 1)
                await self._backoff(attempt, err)
                attempt += 1
        finally:
            self.metrics.dep_latency.labels(self.caller, self.name).observe(time.perf_counter() - t0)


class LocalHandle(Handle):
    """A dependency in this process (``run_local``): the same boundary, no network."""

    def __init__(self, dep: Dependency, caller: str, metrics: ChainMetrics, instance: Chainlet) -> None:
        super().__init__(dep, caller, metrics)
        self.instance = instance

    async def _once(self, call: ChainCall) -> Any:
        args = parse_args(self.sig, call, self.metrics)
        return await execute(self.instance, self.sig, args, self.metrics)

    async def _open(self, call: ChainCall) -> AsyncIterator[Any]:  # type: ignore[override]
        args = parse_args(self.sig, call, self.metrics)
        async for item in execute_stream(self.instance, self.sig, args, self.metrics):
            yield item
