"""The limiter, exact at every boundary: a hypothesis model check of the sliding window (admit
iff what the last window admitted plus the request fits; ``Retry-After`` the exact wait), and
each limit at its edge."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tripod.tenants import OverLimit, SlidingWindow, Tenant, TenantLimiter


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@settings(max_examples=300, deadline=None)
@given(limit=st.integers(1, 50), ops=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 60)), max_size=40))
def test_window_admits_exactly_what_fits(limit: int, ops: list[tuple[int, int]]) -> None:
    """Against a brute-force model: times in tenths of the span (so edges are hit exactly)."""
    span = 10.0
    w = SlidingWindow(span)
    admitted: list[tuple[float, int]] = []
    now = 0.0
    for dt, amount in ops:
        now += dt
        used = sum(a for t, a in admitted if t + span > now)
        wait = w.wait(now, amount, limit)
        if amount > limit:
            assert wait == math.inf
            continue
        assert (wait == 0) == (used + amount <= limit)
        if wait == 0:
            w.add(now, amount)
            admitted.append((now, amount))
        else:
            # The wait is exact: the request fits then, and not an instant before.
            later = now + wait
            assert sum(a for t, a in admitted if t + span > later) + amount <= limit
            assert sum(a for t, a in admitted if t + span > later - 1e-9) + amount > limit


@settings(max_examples=200, deadline=None)
@given(limit=st.integers(1, 100), sizes=st.lists(st.tuples(st.integers(0, 30), st.integers(1, 40),
                                                           st.integers(0, 40)), max_size=30))
def test_output_reservations_and_refunds(limit: int, sizes: list[tuple[int, int, int]]) -> None:
    """Output tokens: max_tokens reserved at admission, the unused part refunded at the end; the
    tokens actually produced in any minute never pass the limit."""
    clock = Clock()
    lim = TenantLimiter(clock)
    t = Tenant("a", output_tokens_per_minute=limit)
    produced: list[tuple[float, int]] = []
    for dt, reserve, used in sizes:
        clock.t += dt
        window = sum(n for at, n in produced if at + 60 > clock.t)
        try:
            lease = lim.admit(t, output_tokens=reserve)
        except OverLimit as e:
            assert e.limit == "output_tokens_per_minute"
            assert e.never == (reserve > limit) or window + reserve > limit
            continue
        assert window + reserve <= limit
        n = min(used, reserve)
        produced.append((clock.t, n))
        lim.release(lease, n)


def test_requests_per_second_at_its_boundary() -> None:
    clock = Clock()
    lim = TenantLimiter(clock)
    t = Tenant("acme", requests_per_second=3)
    for _ in range(3):
        lim.release(lim.admit(t))
    with pytest.raises(OverLimit) as e:
        lim.admit(t)
    assert e.value.limit == "requests_per_second" and e.value.retry_after == pytest.approx(1.0)
    assert str(e.value) == "tenant 'acme' is over its requests_per_second (3)"
    assert e.value.retry_after_header == "1"
    clock.t += 0.999
    with pytest.raises(OverLimit):
        lim.admit(t)
    clock.t += 0.001  # exactly one second after the first: it has left the window
    lim.admit(t)
    # Below one per second: one per 1/R seconds.
    slow = Tenant("slow", requests_per_second=0.25)
    lim.admit(slow)
    with pytest.raises(OverLimit) as e:
        lim.admit(slow)
    assert e.value.retry_after_header == "4"


def test_concurrency_and_token_limits_at_their_boundaries() -> None:
    clock = Clock()
    lim = TenantLimiter(clock)
    t = Tenant("a", max_concurrent=2, input_tokens_per_minute=100)
    a = lim.admit(t, input_tokens=60)
    b = lim.admit(t, input_tokens=40)  # exactly the limit
    with pytest.raises(OverLimit) as e:
        lim.admit(t, input_tokens=0)
    assert e.value.limit == "max_concurrent"
    lim.release(a)
    lim.release(a)  # idempotent
    with pytest.raises(OverLimit) as e:
        lim.admit(t, input_tokens=1)
    assert e.value.limit == "input_tokens_per_minute" and e.value.retry_after == pytest.approx(60.0)
    clock.t += 60.0
    lim.release(lim.admit(t, input_tokens=60))
    with pytest.raises(OverLimit) as e:
        lim.admit(t, input_tokens=101)
    assert e.value.never
    lim.release(b)


def test_a_refusal_takes_nothing() -> None:
    clock = Clock()
    lim = TenantLimiter(clock)
    t = Tenant("a", requests_per_second=1, output_tokens_per_minute=10)
    with pytest.raises(OverLimit):
        lim.admit(t, output_tokens=11)
    lease = lim.admit(t, output_tokens=10)  # the refused request took neither a request nor tokens
    assert lim.states["a"].concurrent == 1
    lim.release(lease, 4)
    clock.t += 1
    lim.release(lim.admit(t, output_tokens=6))  # 6 refunded tokens are free again


_opt = st.one_of(st.none(), st.integers(1, 60))


@settings(max_examples=300, deadline=None)
@given(rps=st.one_of(st.none(), st.sampled_from([0.5, 1, 2, 3])), inp=_opt, out=_opt,
       conc=st.one_of(st.none(), st.integers(1, 4)),
       ops=st.lists(st.tuples(st.sampled_from([0.0, 0.25, 0.5, 1.0, 2.0, 30.0, 60.0]), st.integers(0, 70),
                              st.integers(0, 70), st.integers(0, 70), st.booleans()), max_size=40))
def test_every_limit_together_against_a_model(rps: float | None, inp: int | None, out: int | None,
                                              conc: int | None,
                                              ops: list[tuple[float, int, int, int, bool]]) -> None:
    """All four limits on one tenant, requests of every size: a request is admitted iff it fits
    every limit (a brute-force model of each window, refunds included), a refusal names a limit it
    is over (``never`` iff it alone is larger than the limit) and takes nothing."""
    clock = Clock()
    lim = TenantLimiter(clock)
    t = Tenant("t", requests_per_second=rps, input_tokens_per_minute=inp, output_tokens_per_minute=out,
               max_concurrent=conc)
    span, cap = (1.0, rps) if rps is None or rps >= 1 else (1.0 / rps, 1.0)
    admitted: list[float] = []  # admission times (requests_per_second)
    inputs: list[tuple[float, int]] = []
    outputs: list[list[float]] = []  # [time, tokens still counted]
    live: list[tuple[object, list[float], int]] = []  # (lease, its output entry, reserved)
    for dt, n_in, n_out, used, end_one in ops:
        clock.t += dt
        now = clock.t
        if end_one and live:  # the oldest request ends, having produced ``used`` of its reservation
            lease, entry, reserved = live.pop(0)
            produced = min(used, reserved)
            entry[1] = produced
            lim.release(lease, produced)  # type: ignore[arg-type]
        fits = {
            "max_concurrent": conc is None or len(live) < conc,
            "requests_per_second": rps is None or sum(1 for a in admitted if a + span > now) + 1 <= cap,
            "input_tokens_per_minute": inp is None or sum(n for a, n in inputs if a + 60 > now) + n_in <= inp,
            "output_tokens_per_minute": out is None or sum(e[1] for e in outputs if e[0] + 60 > now) + n_out <= out,
        }
        try:
            lease = lim.admit(t, input_tokens=n_in, output_tokens=n_out)
        except OverLimit as e:
            assert not all(fits.values()), (fits, e)
            assert not fits[e.limit], (fits, e.limit)
            alone = {"input_tokens_per_minute": n_in, "output_tokens_per_minute": n_out}.get(e.limit, 0)
            assert e.never == (alone > e.value), (e.limit, alone, e.value)
            assert e.retry_after > 0
            continue
        assert all(fits.values()), fits
        admitted.append(now)
        inputs.append((now, n_in))
        entry = [now, float(n_out)]
        outputs.append(entry)
        live.append((lease, entry, n_out))
