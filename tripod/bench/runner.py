"""Drive the load: closed loop at fixed concurrency, or open loop at a request rate.

Every loop is bounded by a request count and a wall-clock limit. Agentic requests keep their
session's order: a session's turns run one after another on one worker, with think time.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, replace
from typing import Any

import httpx

from tripod.bench.client import Target, send
from tripod.bench.datasets import BenchRequest
from tripod.bench.metrics import RequestResult


@dataclass(slots=True)
class Level:
    """What one measured run did: its requests' results and its wall time."""

    results: list[RequestResult]
    duration: float
    interrupted: bool = False
    started: float = 0.0  # perf_counter() when the level began (a trace's offsets count from here)


def _units(requests: list[BenchRequest]) -> list[list[BenchRequest]]:
    """Independent units of work: one request, or every turn of one session in order."""
    units: list[list[BenchRequest]] = []
    by_session: dict[str, list[BenchRequest]] = {}
    for r in requests:
        if r.session is None:
            units.append([r])
        elif r.session in by_session:
            by_session[r.session].append(r)
        else:
            by_session[r.session] = [r]
            units.append(by_session[r.session])
    return units


def extend_turn(req: BenchRequest, prev: tuple[BenchRequest, RequestResult] | None) -> BenchRequest | str:
    """``req`` as sent: a turn that ``extends`` its session's previous one (``--agentic-echo``)
    carries the previous prompt's ids, the server's answer ids, then its own new ids, so the server
    sees exactly the conversation it produced. A string says why it cannot be sent (the previous
    turn failed, or the server sent no answer ids: ``return_token_ids`` is tripod's extension)."""
    if not req.extends:
        return req
    if prev is None or not prev[1].ok:
        return "previous_turn_failed"
    sent, res = prev
    if not res.output_ids or len(res.output_ids) != res.output_tokens:
        return "no_token_ids"
    return replace(req, prompt_ids=[*(sent.prompt_ids or []), *res.output_ids, *(req.prompt_ids or [])], extends=False)


async def _send_turn(client: httpx.AsyncClient, target: Target, req: BenchRequest, timeout: float,
                     prev: tuple[BenchRequest, RequestResult] | None) -> tuple[BenchRequest, RequestResult]:
    """Send one turn of a unit (extended from ``prev`` where it says so): what was sent, and its result."""
    sent = extend_turn(req, prev)
    if isinstance(sent, str):
        return req, RequestResult(start=time.perf_counter(), session=req.session, turn=req.turn, error=sent)
    return sent, await send(client, target, sent, timeout)


async def closed_loop(
    target: Target,
    requests: list[BenchRequest],
    concurrency: int,
    *,
    max_duration: float,
    timeout: float,
    on_done: Callable[[RequestResult], None] | None = None,
) -> Level:
    """``concurrency`` workers, each sending its next unit as soon as the last one finished."""
    units = _units(requests)
    queue = iter(units)
    results: list[RequestResult] = []
    deadline = time.perf_counter() + max_duration
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)

    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:

        async def worker() -> None:
            for unit in queue:
                prev: tuple[BenchRequest, RequestResult] | None = None
                for req in unit:
                    if time.perf_counter() >= deadline:
                        return
                    if req.think_time:
                        await asyncio.sleep(req.think_time)  # the user reading / the tool running
                    prev = await _send_turn(client, target, req, timeout, prev)
                    res = prev[1]
                    results.append(res)
                    if on_done is not None:
                        on_done(res)

        t0 = time.perf_counter()
        tasks = [asyncio.create_task(worker()) for _ in range(concurrency)]
        interrupted = False
        try:
            await asyncio.gather(*tasks)
        except asyncio.CancelledError:
            interrupted = True
            for t in tasks:
                t.cancel()
        return Level(results, time.perf_counter() - t0, interrupted, t0)


async def open_loop(
    target: Target,
    requests: list[BenchRequest],
    rate: float,
    *,
    burstiness: float = 1.0,
    max_concurrency: int | None = None,
    max_duration: float,
    timeout: float,
    seed: int = 0,
    on_done: Callable[[RequestResult], None] | None = None,
) -> Level:
    """Arrivals at ``rate`` per second: gamma-distributed gaps with shape ``burstiness``
    (1 = Poisson; < 1 burstier; > 1 more regular), mean 1/rate."""
    rng = random.Random(seed)
    units = _units(requests)
    results: list[RequestResult] = []
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    deadline = time.perf_counter() + max_duration
    limits = httpx.Limits(max_connections=(max_concurrency or 256) + 4)

    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:

        async def run(unit: list[BenchRequest]) -> None:
            prev: tuple[BenchRequest, RequestResult] | None = None
            for req in unit:
                if req.think_time:
                    await asyncio.sleep(req.think_time)
                if sem is not None:
                    async with sem:
                        prev = await _send_turn(client, target, req, timeout, prev)
                else:
                    prev = await _send_turn(client, target, req, timeout, prev)
                res = prev[1]
                results.append(res)
                if on_done is not None:
                    on_done(res)

        t0 = time.perf_counter()

        async def arrivals() -> AsyncIterator[Coroutine[Any, Any, None]]:
            for unit in units:
                if time.perf_counter() >= deadline:
                    return
                yield run(unit)
                await asyncio.sleep(rng.gammavariate(burstiness, 1.0 / (rate * burstiness)))

        interrupted = await _drive(arrivals(), deadline)
        return Level(results, time.perf_counter() - t0, interrupted, t0)


async def trace_replay(
    target: Target,
    requests: list[BenchRequest],
    *,
    max_duration: float,
    timeout: float,
    on_done: Callable[[RequestResult], None] | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> Level:
    """Each request sent at its recorded ``offset`` after the replay's start, whatever is still in
    flight (a recording's arrivals do not wait for the server; a later turn carries its recorded
    history). ``duration`` runs from the first request sent to the last answer."""
    order = sorted(requests, key=lambda r: r.offset or 0.0)
    results: list[RequestResult] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)

    async with httpx.AsyncClient(limits=limits, timeout=timeout, transport=transport) as client:

        async def one(req: BenchRequest) -> None:
            res = await send(client, target, req, timeout)
            results.append(res)
            if on_done is not None:
                on_done(res)

        t0 = time.perf_counter()
        deadline = t0 + max_duration

        async def arrivals() -> AsyncIterator[Coroutine[Any, Any, None]]:
            for req in order:
                at = t0 + (req.offset or 0.0)
                if at >= deadline:
                    return
                wait = at - time.perf_counter()
                if wait > 0:
                    await asyncio.sleep(wait)
                yield one(req)

        interrupted = await _drive(arrivals(), deadline)
        first = t0 + (order[0].offset or 0.0) if order else t0
        return Level(results, max(0.0, time.perf_counter() - first), interrupted, t0)


async def _drive(arrivals: AsyncIterator[Coroutine[Any, Any, None]], deadline: float) -> bool:
    """Start each request the (self-pacing) ``arrivals`` yields, then wait for them until
    ``deadline`` (the unfinished are cancelled). Returns whether the run was interrupted."""
    tasks: list[asyncio.Task[None]] = []
    try:
        async for coro in arrivals:
            tasks.append(asyncio.create_task(coro))
        remaining = max(0.0, deadline - time.perf_counter())
        _, pending = await asyncio.wait(tasks, timeout=remaining) if tasks else (set(), set())
        for t in pending:
            t.cancel()
        return False
    except asyncio.CancelledError:
        for t in tasks:
            t.cancel()
        return True
