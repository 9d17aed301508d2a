"""LPM with aging on the real engine: a stream of cache hits never starves a cache miss.

One request may run at a time (``max_running=1``), so every step the scheduler chooses between
a fresh request that shares a long cached prefix and an older one that shares nothing. Plain LPM
always prefers the hit; aging gives the waiting miss credit until it wins.
"""

from __future__ import annotations

from typing import Any

import pytest

from tripod import SamplingParams

PREFIX = (
    "Transcript of the harbour authority's daily briefing. Tides, berths, pilot schedules and "
    "weather for all vessels entering or leaving the inner basin are listed below in order. "
) * 3


def _run(make_engine: Any, aging: float, stream_requests: int) -> tuple[int | None, int]:
    """Feed one cache-hitting request per step; return (finish step of the miss, steps run)."""
    eng = make_engine(max_running=1, max_batch_tokens=512, policy="lpm", aging=aging)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    eng.generate(PREFIX + "Entry 0:", params)  # warm the cache with the shared prefix
    miss = eng.add_request("Completely unrelated: a recipe for lentil soup starts with", params)[0]
    done_at: int | None = None
    step = 0
    for i in range(stream_requests):
        eng.add_request(PREFIX + f"Entry {i + 1}:", params)
        eng.step()
        step += 1
        if miss.finished and done_at is None:
            done_at = step
    while eng.has_work:  # drain; the miss must finish eventually either way
        eng.step()
        step += 1
        if miss.finished and done_at is None:
            done_at = step
    assert miss.finish_reason is not None and len(miss.output_ids) == 2
    eng.assert_consistent()
    return done_at, stream_requests


@pytest.mark.slow
def test_aging_serves_the_miss_while_hits_keep_coming(make_engine: Any) -> None:
    done_at, stream = _run(make_engine, aging=16.0, stream_requests=60)
    assert done_at is not None and done_at < stream, (
        f"the cache miss finished at step {done_at}, only after the {stream}-request stream"
    )


@pytest.mark.slow
def test_without_aging_the_stream_of_hits_starves_the_miss(make_engine: Any) -> None:
    # The control: with no aging the miss waits until the stream of hits ends.
    done_at, stream = _run(make_engine, aging=0.0, stream_requests=30)
    assert done_at is not None and done_at > stream
