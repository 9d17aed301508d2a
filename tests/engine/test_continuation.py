"""Continuing a request from tokens it already generated (the engine's side of the router's
mid-stream failover): the engine behaves exactly as if it had generated them itself.

For every cut point k, a continuation carrying the first k output tokens yields the rest of the
undisturbed answer token for token (fp32): greedy, seeded sampling with penalties, ``n`` > 1 copies
continued independently, a JSON-schema constraint (the matcher advanced through the resumed
tokens), speculative decoding. Invalid continuations are refused with a message.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import jsonschema
import pytest
import torch

from tripod.engine.request import GrammarSpec, Req, Resume, SamplingParams

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                           "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                    "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Any:
    """These tests run short answers one at a time: one thread does it about as fast, and on a
    busy 2-core machine two threads spin against each other (10x slower). Restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def run(engine: Any, copies: list[Req]) -> None:
    while any(not r.finished for r in copies):
        engine.step()
    engine.step()  # reports what finished (and leaves nothing behind)


def continued(engine: Any, prompt: list[int], params: SamplingParams, resume: Sequence[Resume]) -> dict[int, Req]:
    copies = engine.add_request(prompt, params, resume=resume)
    assert sorted(r.index for r in copies) == sorted(r.index for r in resume)
    run(engine, copies)
    return {r.index: r for r in copies}


@pytest.fixture
def prompt(engine: Any) -> list[int]:
    return list(engine.apply_chat_template([{"role": "user", "content": "Tell me a story about a lighthouse."}]))


def test_greedy_continuation_equals_the_undisturbed_answer(engine: Any, prompt: list[int]) -> None:
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=1)
    ref = engine.generate(prompt, params)[0]
    assert len(ref.token_ids) == 24
    for k in (1, 23):
        got = continued(engine, prompt, params, [Resume(0, tuple(ref.token_ids[:k]))])[0]
        assert got.output_ids == ref.token_ids, k
        assert got.finish_reason is not None and got.finish_reason.value == ref.finish_reason
        # Logprobs continue: the continuation's own tokens have the undisturbed ones'.
        assert [(lp.token_id, lp.logprob) for lp in got.output_logprobs] == \
            [(lp.token_id, lp.logprob) for lp in ref.logprobs[k:]]
    engine.assert_consistent()


@pytest.mark.slow
def test_seeded_sampling_with_penalties_and_n_copies_continue_exactly(engine: Any, prompt: list[int]) -> None:
    """Counter-based noise: copy i at output position k draws what it would have drawn; the
    frequency/presence/repetition penalties count the resumed tokens as output."""
    params = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=1234, n=3, ignore_eos=True,
                            frequency_penalty=0.6, presence_penalty=0.3, repetition_penalty=1.2)
    ref = {o.index: o.token_ids for o in engine.generate(prompt, params)}
    assert len({tuple(v) for v in ref.values()}) == 3  # the copies really differ
    # Copies 0 and 2 cut at different points, copy 1 finished already (not resumed).
    got = continued(engine, prompt, params, [Resume(0, tuple(ref[0][:5])), Resume(2, tuple(ref[2][:19]))])
    assert got[0].output_ids == ref[0]
    assert got[2].output_ids == ref[2]
    assert got[0].rid.endswith("-0") and got[2].rid.endswith("-2")


@pytest.mark.slow
def test_json_constraint_continues_through_the_resumed_tokens(engine: Any) -> None:
    prompt = list(engine.apply_chat_template([{"role": "user", "content": "Describe a person as JSON."}]))
    params = SamplingParams(max_tokens=80, temperature=0.0, grammar=GrammarSpec("json", json.dumps(SCHEMA)))
    ref = engine.generate(prompt, params)[0]
    jsonschema.validate(json.loads(ref.text), SCHEMA)
    cut = len(ref.token_ids) // 2
    got = continued(engine, prompt, params, [Resume(0, tuple(ref.token_ids[:cut]))])[0]
    assert got.output_ids == ref.token_ids
    jsonschema.validate(json.loads(engine.decode(got.output_ids)), SCHEMA)
    # Tokens the grammar refuses: the continuation is rejected, saying why.
    bad = engine.encode("hello")
    refused = continued(engine, prompt, params, [Resume(0, tuple(bad))])[0]
    assert refused.finish_reason is not None and refused.finish_reason.value == "rejected"
    assert refused.error is not None and "output constraint" in refused.error
    engine.assert_consistent()


@pytest.mark.slow
def test_continuation_under_speculative_decoding(make_engine: Any, engine: Any) -> None:
    """A continued request speculates from its resumed output like any other (its n-gram index
    covers the resumed tokens): the tokens are still plain decoding's. (Draft models guessing
    with the noise of the positions they draft: tests/engine/test_speculative.py, seeded.)"""
    method = "ngram"
    spec = make_engine(speculative=method, spec_adaptive=False)
    text = "Repeat exactly: the quick brown fox jumps over the lazy dog, the quick brown fox jumps again."
    prompt = list(engine.apply_chat_template([{"role": "user", "content": text}]))
    for sampling in ({"temperature": 0.0}, {"temperature": 0.7, "seed": 5}):
        params = SamplingParams(max_tokens=32, ignore_eos=True, **sampling)  # type: ignore[arg-type]
        ref = engine.generate(prompt, params)[0].token_ids
        got = continued(spec, prompt, params, [Resume(0, tuple(ref[:11]))])[0]
        assert got.output_ids == ref, (method, sampling)
    spec.assert_consistent()


def test_invalid_continuations_are_refused(engine: Any, prompt: list[int]) -> None:
    params = SamplingParams(max_tokens=4, temperature=0.0, n=2)
    eos = next(iter(engine.eos_ids))
    cases = [
        ([Resume(2, (1,))], "indices"),
        ([Resume(0, (1,)), Resume(0, (2,))], "distinct"),
        ([Resume(0, (1, 2, 3, 4))], "nothing is left"),
        ([Resume(1, (1, eos))], "stop token"),
        ([Resume(0, (10**7,))], "token ids"),
        ([], "at least one"),
    ]
    for resume, why in cases:
        with pytest.raises(ValueError, match=why):
            engine.add_request(prompt, params, resume=resume)
    assert not engine.has_work


@pytest.mark.parametrize("text", ["\U0009ca3e!", "\u00b2\U0009ca3e\u00e4iV\u0082)\"~"], ids=["first", "later"])
def test_a_constraint_no_token_can_write_is_rejected_not_fatal(engine: Any, prompt: list[int], text: str) -> None:
    """(Found by the API fuzzing: a grammar whose next character no token writes — here a plane-9
    character, whose first UTF-8 byte this vocabulary has no token for — left every logit masked,
    and the engine asserted and died.) The request is rejected with a message, at the first token
    (a plain sample) or later (a jump-forward verification)."""
    odd = json.dumps([text])
    copies = engine.add_request(prompt, SamplingParams(max_tokens=8, temperature=0.0,
                                                       grammar=GrammarSpec("choice", odd)))
    run(engine, copies)
    r = copies[0]
    assert r.finish_reason is not None and r.finish_reason.value == "rejected", (r.finish_reason, r.output_ids)
    assert r.error is not None and "cannot be written" in r.error
    assert engine.generate(prompt, SamplingParams(max_tokens=3, temperature=0.0))[0].token_ids  # still serving
