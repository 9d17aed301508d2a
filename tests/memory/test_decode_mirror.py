"""The decode mirror (a dense copy of decoding requests' KV) must be invisible in the outputs.

Rows join, leave (finished requests; the last row moves into the hole), fall out of step
(retraction) and the whole mirror is dropped when it would outgrow its budget; through all of it
greedy tokens must equal those of the plain gather path.
"""

from __future__ import annotations

from typing import Any

import pytest

from tripod import SamplingParams


@pytest.fixture(scope="module")
def plain(make_engine: Any) -> Any:
    return make_engine(decode_mirror=False, kv_cache_tokens=4096)


def _workload(engine: Any) -> tuple[list[Any], list[SamplingParams]]:
    prompts: list[Any] = [
        "The three primary colours are",
        "def fibonacci(n):",
        "Une brève histoire de Paris:",
        "List of prime numbers: 2, 3, 5,",
        engine.apply_chat_template([{"role": "user", "content": "Name a large mammal."}]),
        "In 1969, the first humans",
    ]
    # Different lengths: requests leave at different steps, so rows are removed and compacted
    # while others keep decoding.
    params = [
        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=2)
        for n in (5, 23, 9, 31, 14, 18)
    ]
    return prompts, params


def test_mirror_gives_the_same_greedy_tokens_as_gathering(
    make_engine: Any, plain: Any, check_greedy: Any, greedy_from_tripod: Any
) -> None:
    mirrored = make_engine(kv_cache_tokens=4096)
    assert mirrored.runner.mirror is not None and plain.runner.mirror is None
    prompts, params = _workload(mirrored)
    ref = plain.generate(prompts, params)
    got = mirrored.generate(prompts, params)
    for i, (g, r) in enumerate(zip(got, ref, strict=True)):
        check_greedy(g.token_ids, greedy_from_tripod(r), f"prompt {i}")
    mirrored.assert_consistent()
    assert not mirrored.runner.mirror.owner, "finished requests still hold mirror rows"


@pytest.mark.slow
def test_mirror_survives_retraction(
    make_engine: Any, plain: Any, check_greedy: Any, greedy_from_tripod: Any
) -> None:
    # 96 slots for six requests that need ~180: decodes run out of memory, requests are
    # retracted and recomputed while the mirror holds rows for them.
    tiny = make_engine(kv_cache_tokens=96)
    prompts, params = _workload(tiny)
    ref = plain.generate(prompts, params)
    got = tiny.generate(prompts, params)
    assert tiny.scheduler.num_retractions > 0, "the budget was meant to force retraction"
    for i, (g, r) in enumerate(zip(got, ref, strict=True)):
        check_greedy(g.token_ids, greedy_from_tripod(r), f"prompt {i}")
    tiny.assert_consistent()


@pytest.mark.slow
def test_mirror_outgrowing_its_budget_falls_back_to_gathering(
    make_engine: Any, plain: Any, check_greedy: Any, greedy_from_tripod: Any
) -> None:
    small = make_engine(kv_cache_tokens=4096)
    mirror = small.runner.mirror
    # Room for a few short rows only: the mirror fills, then is dropped as requests grow.
    mirror.max_bytes = 3 * 24 * mirror._row_token_bytes
    prompts, params = _workload(small)
    ref = plain.generate(prompts, params)
    got = small.generate(prompts, params)
    assert mirror.drops > 0
    for i, (g, r) in enumerate(zip(got, ref, strict=True)):
        check_greedy(g.token_ids, greedy_from_tripod(r), f"prompt {i}")
    small.assert_consistent()
