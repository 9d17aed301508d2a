"""Per-tenant limits, enforced exactly at their boundaries.

- ``requests_per_second`` R: at most R admissions in any window of 1 s (for R < 1: one per 1/R s).
- ``input_tokens_per_minute`` / ``output_tokens_per_minute``: the tokens admitted in any window of
  60 s stay within the limit. Input tokens are known at admission. Output tokens are *reserved* at
  admission (the request's ``max_tokens`` times its ``n``: the most it may produce) and the unused
  part is refunded when it ends, so a tenant can never exceed its output budget, and a request
  that would is refused before it starts instead of being cut mid-answer.
- ``max_concurrent``: requests admitted and not yet ended.

A refusal (:class:`OverLimit`) names the limit and says how long until the limit would admit the
same request (``Retry-After``). Single-threaded: the server's and the router's event loops call it.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from tripod.tenants.model import Tenant


class OverLimit(Exception):
    """A request over its tenant's ``limit`` (429); ``retry_after`` seconds until it would fit.
    ``never``: the request alone is larger than the limit (it must be made smaller: 400)."""

    def __init__(self, tenant: str, limit: str, value: float, retry_after: float, never: bool = False) -> None:
        shown = int(value) if float(value).is_integer() else value
        msg = f"tenant {tenant!r} is over its {limit} ({shown})"
        if never:
            msg = f"the request alone is more than tenant {tenant!r}'s {limit} ({shown}) allows; ask for less"
        super().__init__(msg)
        self.tenant, self.limit, self.value = tenant, limit, value
        self.retry_after = retry_after
        self.never = never

    @property
    def retry_after_header(self) -> str:
        """Whole seconds, rounded up (a client retrying then is admitted, unless others came first)."""
        return str(max(1, math.ceil(self.retry_after - 1e-9)))


@dataclass(slots=True)
class _Entry:
    t: float
    amount: float
    live: bool = True


class SlidingWindow:
    """Amounts admitted in the last ``span`` seconds: an entry admitted at t counts while now < t + span."""

    def __init__(self, span: float) -> None:
        self.span = span
        self.entries: deque[_Entry] = deque()
        self.total = 0.0

    def expire(self, now: float) -> None:
        while self.entries and self.entries[0].t + self.span <= now:
            e = self.entries.popleft()
            e.live = False
            self.total -= e.amount

    def wait(self, now: float, amount: float, limit: float) -> float:
        """Seconds until ``amount`` more fits under ``limit`` (0: now; inf: never)."""
        self.expire(now)
        if amount > limit:
            return math.inf
        excess = self.total + amount - limit
        if excess <= 0:
            return 0.0
        for e in self.entries:
            excess -= e.amount
            if excess <= 0:
                return e.t + self.span - now
        return math.inf  # unreachable: expiring everything frees the whole window

    def add(self, now: float, amount: float) -> _Entry:
        e = _Entry(now, amount)
        self.entries.append(e)
        self.total += amount
        return e

    def refund(self, e: _Entry, amount: float) -> None:
        amount = min(amount, e.amount)
        e.amount -= amount
        if e.live:
            self.total -= amount


@dataclass(slots=True)
class _State:
    rps: SlidingWindow | None = None
    rps_span: float = 1.0
    inputs: SlidingWindow = field(default_factory=lambda: SlidingWindow(60.0))
    outputs: SlidingWindow = field(default_factory=lambda: SlidingWindow(60.0))
    concurrent: int = 0


@dataclass(slots=True)
class Lease:
    """One admitted request's hold on its tenant's limits; :meth:`TenantLimiter.release` ends it."""

    tenant: str
    reserved_output: int
    output_entry: _Entry | None
    released: bool = False


def rps_window(rate: float) -> tuple[float, float]:
    """(span, capacity): R per second as R admissions per 1 s, or (R < 1) one per 1/R s."""
    return (1.0, rate) if rate >= 1 else (1.0 / rate, 1.0)


class TenantLimiter:
    """Each tenant's windows and in-flight count, by name (kept across reloads of the file: a
    tenant's new limits apply to what it already used)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.states: dict[str, _State] = {}

    def _state(self, t: Tenant) -> _State:
        s = self.states.setdefault(t.name, _State())
        if t.requests_per_second is not None:
            span, _ = rps_window(t.requests_per_second)
            if s.rps is None or s.rps.span != span:
                s.rps = SlidingWindow(span)
        return s

    def refusal(self, t: Tenant) -> OverLimit | None:
        """The refusal ``admit`` would give any request of ``t``'s now by the limits that need no
        counts (``max_concurrent``, ``requests_per_second``), or None; takes nothing. Lets a flood
        be refused before its requests are read and tokenized."""
        now = self.clock()
        s = self._state(t)
        if t.max_concurrent is not None and s.concurrent >= t.max_concurrent:
            return OverLimit(t.name, "max_concurrent", t.max_concurrent, 1.0)
        if t.requests_per_second is not None:
            assert s.rps is not None
            wait = s.rps.wait(now, 1, rps_window(t.requests_per_second)[1])
            if wait > 0:
                return OverLimit(t.name, "requests_per_second", t.requests_per_second, wait)
        return None

    def admit(self, t: Tenant, input_tokens: int | None = None, output_tokens: int | None = None) -> Lease:
        """Admit one request (``None`` token counts: those limits are not checked here, as in the
        router, which does not tokenize), or raise :class:`OverLimit` and change nothing."""
        now = self.clock()
        s = self._state(t)
        if t.max_concurrent is not None and s.concurrent >= t.max_concurrent:
            raise OverLimit(t.name, "max_concurrent", t.max_concurrent, 1.0)
        checks: list[tuple[str, float, SlidingWindow, float]] = []
        if t.requests_per_second is not None:
            assert s.rps is not None
            checks.append(("requests_per_second", t.requests_per_second, s.rps, 1))
        if t.input_tokens_per_minute is not None and input_tokens is not None:
            checks.append(("input_tokens_per_minute", t.input_tokens_per_minute, s.inputs, input_tokens))
        if t.output_tokens_per_minute is not None and output_tokens is not None:
            checks.append(("output_tokens_per_minute", t.output_tokens_per_minute, s.outputs, output_tokens))
        for name, value, window, amount in checks:
            cap = rps_window(value)[1] if name == "requests_per_second" else value
            wait = window.wait(now, amount, cap)
            if wait == math.inf:
                raise OverLimit(t.name, name, value, window.span, never=True)
            if wait > 0:
                raise OverLimit(t.name, name, value, wait)
        # NOTE: every check passed before anything is taken: a refusal leaves the windows as they were.
        if t.requests_per_second is not None:
            assert s.rps is not None
            s.rps.add(now, 1)
        if input_tokens:
            s.inputs.add(now, input_tokens)
        entry = s.outputs.add(now, output_tokens) if output_tokens else None
        s.concurrent += 1
        return Lease(t.name, output_tokens or 0, entry)

    def release(self, lease: Lease, output_used: int | None = None) -> None:
        """End ``lease``: the in-flight count drops and the unused output reservation is refunded
        (``output_used`` None: all of it was used). Idempotent."""
        if lease.released:
            return
        lease.released = True
        s = self.states.get(lease.tenant)
        if s is None:
            return
        s.concurrent -= 1
        if lease.output_entry is not None and output_used is not None:
            s.outputs.refund(lease.output_entry, max(0, lease.reserved_output - output_used))
