"""Jump-forward never changes the output: greedy and seeded outputs are token-identical with it on
and off on the whole suite, and unseeded sampling keeps its distribution."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import jsonschema
import pytest

from tests.support.structured_suite import SCHEMAS, json_prompt, text_prompt
from tripod.engine.request import SamplingParams
from tripod.engine.structured import GrammarSpec


@pytest.fixture(scope="module")
def engines(make_engine: Any) -> Iterator[tuple[Any, Any]]:
    on, off = make_engine(kv_cache_tokens=16384), make_engine(kv_cache_tokens=16384, jump_forward=False)
    assert on.config.jump_forward and not off.config.jump_forward
    yield on, off
    for e in (on, off):
        assert not e.has_work
        e.assert_consistent()


def _suite(engine: Any, **kw: Any) -> tuple[list[Any], list[Any]]:
    names = list(SCHEMAS)
    prompts = [engine.apply_chat_template(json_prompt(n, SCHEMAS[n])) for n in names]
    params = [SamplingParams(max_tokens=160, grammar=GrammarSpec("json", json.dumps(SCHEMAS[n])), **kw) for n in names]
    return names, engine.generate(prompts, params)


@pytest.mark.slow
@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 0.8, "seed": 5, "top_p": 0.95}],
                         ids=["greedy", "seeded"])
def test_suite_is_token_identical_with_and_without_jump_forward(engines: tuple[Any, Any], sampling: dict[str, Any]) -> None:
    on, off = engines
    steps_on, steps_off = on.stats.steps, off.stats.steps
    accepted = on.stats.jump_forward_accepted
    names, with_jf = _suite(on, **sampling)
    _, without = _suite(off, **sampling)
    for name, a, b in zip(names, with_jf, without, strict=True):
        assert a.token_ids == b.token_ids, (name, a.text, b.text)
        assert a.finish_reason == b.finish_reason == "stop", name
        jsonschema.validate(json.loads(a.text), SCHEMAS[name])
    assert on.stats.jump_forward_accepted > accepted  # it did jump
    assert on.stats.steps - steps_on < off.stats.steps - steps_off  # in fewer forward passes
    assert off.stats.jump_forward_proposed == 0


def test_logprobs_are_the_same_with_and_without_jump_forward(engines: tuple[Any, Any]) -> None:
    on, off = engines
    schema = SCHEMAS["long-fixed-keys"]
    prompt = on.apply_chat_template(json_prompt("customer", schema))
    sp = SamplingParams(max_tokens=120, temperature=0, logprobs=3, grammar=GrammarSpec("json", json.dumps(schema)))
    a, b = on.generate(prompt, sp)[0], off.generate(prompt, sp)[0]
    assert a.token_ids == b.token_ids
    assert a.logprobs is not None and b.logprobs is not None
    for x, y in zip(a.logprobs, b.logprobs, strict=True):
        assert x.token_id == y.token_id and x.logprob == pytest.approx(y.logprob, abs=1e-4)
        assert [t for t, _ in x.top] == [t for t, _ in y.top]


CHOICES = ["The answer is yes", "The answer is no", "The answer is maybe", "The answer is unclear"]


def _distribution(engine: Any, rounds: int) -> Counter[str]:
    prompt = engine.apply_chat_template(text_prompt("Is the sky green? Answer in a sentence."))
    sp = SamplingParams(max_tokens=20, temperature=1.0, n=100, grammar=GrammarSpec("choice", json.dumps(CHOICES)))
    counts: Counter[str] = Counter()
    for _ in range(rounds):
        counts.update(o.text for o in engine.generate(prompt, sp))
    return counts


@pytest.mark.slow  # a two-sample test over many samples
def test_sampled_distribution_is_unchanged(engines: tuple[Any, Any]) -> None:
    """Unseeded sampling draws other random numbers with jump-forward on, so compare the
    distributions: a chi-square two-sample test over the choices (critical value at p = 0.001)."""
    on, off = engines
    accepted = on.stats.jump_forward_accepted
    a, b = _distribution(on, 4), _distribution(off, 4)
    assert on.stats.jump_forward_accepted > accepted  # "The answer is " was jumped over
    assert set(a) <= set(CHOICES) and set(b) <= set(CHOICES)
    cats = [c for c in CHOICES if a[c] + b[c] > 0]
    na, nb = sum(a.values()), sum(b.values())
    chi2 = 0.0
    for c in cats:
        pooled = (a[c] + b[c]) / (na + nb)
        for got, n in ((a[c], na), (b[c], nb)):
            chi2 += (got - n * pooled) ** 2 / (n * pooled)
    critical = {1: 10.83, 2: 13.82, 3: 16.27}[len(cats) - 1]
    assert chi2 < critical, (a, b, chi2)
    assert len(cats) >= 2  # the test means something only if the model spreads its choice


@pytest.mark.slow
def test_bfloat16_requests_alone_are_token_identical(base_engine: Any) -> None:
    """In 16-bit, SDPA's result depends on how far keys are padded, so verification attends
    position by position exactly like a lone decode: a request decoded alone gives the same
    tokens with jump-forward on and off in bfloat16 too."""
    from tripod import Engine

    eng = Engine(dtype="bfloat16", kv_cache_tokens=8192)
    names = ["long-fixed-keys", "refs", "one-of-pets", "nested-address", "array-of-objects", "matrix"]
    runs: dict[bool, list[list[int]]] = {}
    for jf in (True, False):
        eng.config = replace(eng.config, jump_forward=jf)
        eng.reset_prefix_cache()
        runs[jf] = []
        for n in names:
            p = eng.apply_chat_template(json_prompt(n, SCHEMAS[n]))
            out = eng.generate(p, SamplingParams(max_tokens=160, temperature=0, grammar=GrammarSpec("json", json.dumps(SCHEMAS[n]))))[0]
            jsonschema.validate(json.loads(out.text), SCHEMAS[n])
            runs[jf].append(out.token_ids)
    assert runs[True] == runs[False]
    assert eng.stats.jump_forward_accepted > 0
    eng.assert_consistent()
