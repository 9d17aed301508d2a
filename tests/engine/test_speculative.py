"""Speculative decoding never changes the output: every proposer (n-gram, a draft model, the
model's own first layers) gives greedy and seeded outputs token-identical to plain decoding
(fp32), alone and in mixed batches, with logprobs identical; unseeded sampling keeps its
distribution (two-sample test); stops, length limits, n > 1, the prefix cache, chunked prefill,
retraction and abort all behave as without speculation, and every KV slot is accounted for."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.support.server_helpers import assert_same_answer
from tripod.engine.request import SamplingParams
from tripod.engine.speculative.adaptive import AdaptivePolicy, SpecState, expected_tokens
from tripod.engine.speculative.ngram import NgramIndex
from tripod.engine.structured import GrammarSpec

PASSAGE = (
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. "
    "How vexingly quick daft zebras jump. Sphinx of black quartz, judge my vow. "
    "The five boxing wizards jump quickly. Jackdaws love my big sphinx of quartz."
)
CODE = (
    "def total(items):\n    result = 0\n    for item in items:\n        result += item.price * item.count\n"
    "    return result\n\n\ndef average(items):\n    return total(items) / max(1, len(items))\n"
)
PROMPTS = [
    "Repeat the following text exactly, word for word:\n\n" + PASSAGE,
    "Rename the variable `result` to `acc` in this code and give back the whole code:\n\n" + CODE,
    "Write a short poem about the sea.",
]
# self:24 is the slowest proposer here (a draft of most of the model's layers): its tests run with
# the long ones (CI runs them).
METHODS = ["ngram", "draft:embedded", pytest.param("self:24", marks=pytest.mark.slow)]


def chat(engine: Any, text: str) -> list[int]:
    return list(engine.apply_chat_template([{"role": "user", "content": text}]))


@pytest.fixture(scope="module")
def plain(make_engine: Any) -> Iterator[Any]:
    eng = make_engine(kernels="optimized", kv_cache_tokens=16384)
    yield eng
    eng.assert_consistent()


class Reference:
    """The plain engine's outputs of one request alone, computed once per module: every proposer's
    test compares against the same ones (greedy or seeded, so they are the same each time)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._memo: dict[tuple[tuple[int, ...], str], list[Any]] = {}

    def __call__(self, ids: list[int], sp: SamplingParams) -> list[Any]:
        assert sp.temperature == 0 or sp.seed is not None, "only a deterministic request's outputs can be reused"
        key = (tuple(ids), repr(sp))
        if key not in self._memo:
            self._memo[key] = self.engine.generate(ids, sp)
        return self._memo[key]


@pytest.fixture(scope="module")
def reference(plain: Any) -> Reference:
    return Reference(plain)


@pytest.fixture(scope="module", params=METHODS)
def spec(request: Any, make_engine: Any) -> Iterator[Any]:
    eng = make_engine(kernels="optimized", kv_cache_tokens=16384, speculative=request.param, spec_max_batch=64,
                      spec_adaptive=False)
    yield eng
    assert not eng.has_work
    eng.assert_consistent()


def counts(engine: Any) -> tuple[int, int, int]:
    c = [v for k, v in engine.stats.spec.items() if k != "jump_forward"]
    return sum(x.drafts for x in c), sum(x.draft_tokens for x in c), sum(x.accepted_tokens for x in c)


@pytest.mark.slow
@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 0.8, "seed": 11, "top_p": 0.95}],
                         ids=["greedy", "seeded"])
def test_token_identical_to_plain_decoding(plain: Any, reference: Reference, spec: Any,
                                           sampling: dict[str, Any]) -> None:
    before = counts(spec)
    prompts = [chat(plain, p) for p in PROMPTS]
    sp = SamplingParams(max_tokens=80, logprobs=2, **sampling)
    want = [reference(p, sp)[0] for p in prompts]  # alone
    got = spec.generate(prompts, sp)  # batched together
    for a, b in zip(got, want, strict=True):
        assert a.token_ids == b.token_ids, (spec.config.speculative, a.text, b.text)
        assert a.finish_reason == b.finish_reason
        assert a.logprobs is not None and b.logprobs is not None
        got_lp = [(x.token_id, x.logprob, x.top) for x in a.logprobs]
        want_lp = [(y.token_id, y.logprob, y.top) for y in b.logprobs]
        assert_same_answer(got_lp, want_lp)  # bit for bit on the kernels
    drafts, _, accepted = counts(spec)
    assert drafts > before[0]  # it did speculate
    if not spec.config.speculative.startswith("self"):  # a truncated draft of this tiny model rarely guesses right
        assert accepted > before[2]


@pytest.mark.slow
def test_mixed_batch_with_plain_structured_and_opted_out_requests(plain: Any, reference: Reference,
                                                                   spec: Any) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    reqs = [
        (PROMPTS[0], SamplingParams(max_tokens=60, temperature=0)),
        (PROMPTS[1], SamplingParams(max_tokens=60, temperature=0, speculative=False)),
        ("Give a person as JSON.", SamplingParams(max_tokens=60, temperature=0,
                                                  grammar=GrammarSpec("json", json.dumps(schema)))),
        (PROMPTS[2], SamplingParams(max_tokens=40, temperature=0.7, seed=3, n=2)),
        (PROMPTS[0], SamplingParams(max_tokens=60, temperature=0, repetition_penalty=1.3, frequency_penalty=0.5)),
    ]
    prompts = [chat(plain, t) for t, _ in reqs]
    got = spec.generate(prompts, [p for _, p in reqs])
    want = [o for (_, p), ids in zip(reqs, prompts, strict=True) for o in reference(ids, p)]
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    json.loads(got[2].text)


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 7])
def test_length_limit_inside_an_accepted_run(plain: Any, reference: Reference, spec: Any, max_tokens: int) -> None:
    ids = chat(plain, PROMPTS[0])
    sp = SamplingParams(max_tokens=max_tokens, temperature=0)
    a, b = spec.generate(ids, sp)[0], reference(ids, sp)[0]
    assert a.token_ids == b.token_ids and len(a.token_ids) == max_tokens and a.finish_reason == "length"


def test_stop_token_inside_an_accepted_run(plain: Any, reference: Reference, spec: Any) -> None:
    ids = chat(plain, PROMPTS[0])
    full = reference(ids, SamplingParams(max_tokens=40, temperature=0))[0].token_ids
    stop = full[12]  # a copied word: the draft runs through it
    sp = SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[stop])
    a, b = spec.generate(ids, sp)[0], reference(ids, sp)[0]
    assert a.token_ids == b.token_ids == full[: full.index(stop) + 1]
    assert a.finish_reason == "stop"


@pytest.mark.slow
def test_prefix_cache_and_chunked_prefill(make_engine: Any, plain: Any) -> None:
    """A prompt longer than a prefill chunk, twice (the second from the radix cache): the same
    tokens; a separate draft model keeps its KV in step with the chunks (it accepts as much the
    second time, from cached draft KV)."""
    eng = make_engine(kernels="optimized", kv_cache_tokens=16384, speculative="draft:embedded", chunk_size=64,
                      spec_adaptive=False)
    ids = chat(plain, "Repeat this twice:\n\n" + PASSAGE + "\n\n" + PASSAGE)
    assert len(ids) > 2 * 64
    sp = SamplingParams(max_tokens=48, temperature=0)
    want = plain.generate(ids, sp)[0].token_ids
    first = eng.generate(ids, sp)[0]
    acc1 = counts(eng)[2]
    second = eng.generate(ids, sp)[0]
    assert first.token_ids == second.token_ids == want
    assert second.cached_tokens > 0
    _, tokens, accepted = counts(eng)
    assert accepted / tokens > 0.8  # the embedded model drafting for itself
    assert accepted - acc1 >= 0.8 * acc1
    eng.assert_consistent()


@pytest.mark.slow
def test_fully_cached_prompt_is_accounted_before_speculating(make_engine: Any, plain: Any) -> None:
    """A prompt served from the cache but for its last token: that token's one-token prefill
    step is the prompt's (prefix insertion, cached-token accounting), not a speculation round."""
    eng = make_engine(kernels="optimized", speculative="self:24", spec_adaptive=False)
    ids = chat(plain, PROMPTS[0])
    sp = SamplingParams(max_tokens=20, temperature=0)
    a = eng.generate(ids, sp)[0]
    before = eng.stats.cached_prompt_tokens
    b = eng.generate(ids, sp)[0]
    assert a.token_ids == b.token_ids == plain.generate(ids, sp)[0].token_ids
    assert b.cached_tokens == len(ids) - 1
    assert eng.stats.cached_prompt_tokens - before == b.cached_tokens
    eng.assert_consistent()


@pytest.mark.slow  # about 20 s
def test_retraction_under_kv_pressure_and_n(make_engine: Any, plain: Any) -> None:
    eng = make_engine(kernels="optimized", kv_cache_tokens=600, speculative="ngram")
    prompts = [chat(plain, PROMPTS[0]), chat(plain, PROMPTS[2])]
    sp = SamplingParams(max_tokens=200, temperature=0.6, seed=2, n=3, ignore_eos=True)
    got = eng.generate(prompts, sp)
    want = plain.generate(prompts, sp)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert eng.scheduler.num_retractions > 0 and counts(eng)[2] > 0
    eng.assert_consistent()


def test_abort_mid_stream_frees_everything(spec: Any) -> None:
    stream = spec.stream(chat(spec, PROMPTS[0]), SamplingParams(max_tokens=100, temperature=0))
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    assert not spec.has_work
    spec.assert_consistent()


def test_big_batches_do_not_speculate(make_engine: Any, plain: Any) -> None:
    eng = make_engine(kernels="optimized", speculative="ngram", spec_max_batch=2)
    ids = chat(plain, PROMPTS[0])
    eng.generate([ids] * 4, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    assert counts(eng)[0] == 0
    eng.generate([ids] * 2, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    assert counts(eng)[0] > 0


def test_reference_path_is_token_identical(make_engine: Any, engine: Any) -> None:
    """The float32 reference path (torch attention, decode mirror) verifies drafts too."""
    eng = make_engine(speculative="ngram")
    ids = chat(engine, PROMPTS[0])
    sp = SamplingParams(max_tokens=30, temperature=0)
    assert eng.generate(ids, sp)[0].token_ids == engine.generate(ids, sp)[0].token_ids
    assert counts(eng)[2] > 0
    eng.assert_consistent()


def _chi2_p(a: Counter[int], b: Counter[int]) -> float:
    """Chi-square two-sample homogeneity p-value (categories with few counts pooled)."""
    na, nb = sum(a.values()), sum(b.values())
    cats = sorted(set(a) | set(b), key=lambda c: -(a[c] + b[c]))
    big = [c for c in cats if a[c] + b[c] >= 10]
    rest = [c for c in cats if c not in big]
    rows = [(a[c], b[c]) for c in big] + ([(sum(a[c] for c in rest), sum(b[c] for c in rest))] if rest else [])
    rows = [r for r in rows if sum(r) > 0]
    chi2 = 0.0
    for x, y in rows:
        pooled = (x + y) / (na + nb)
        chi2 += (x - na * pooled) ** 2 / (na * pooled) + (y - nb * pooled) ** 2 / (nb * pooled)
    df = max(1, len(rows) - 1)
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), torch.tensor(chi2 / 2.0, dtype=torch.float64)))


@pytest.mark.slow  # a two-sample test over many samples
@pytest.mark.parametrize("method", ["self:20", "ngram"])
def test_unseeded_sampling_keeps_its_distribution(make_engine: Any, plain: Any, method: str) -> None:
    """Unseeded draws differ with speculation (the rejection rule for a sampling draft model; the
    plain rule for n-gram), so compare distributions of the 2nd, 3rd and 4th tokens."""
    eng = make_engine(kernels="optimized", kv_cache_tokens=16384, speculative=method, spec_max_batch=512,
                      spec_adaptive=False)
    ids = chat(plain, "Repeat exactly: the cat sat on the mat, the cat sat on the mat, the cat sat on the")
    sp = SamplingParams(max_tokens=4, temperature=1.0, n=100, ignore_eos=True)
    outs_a = [o for _ in range(4) for o in eng.generate(ids, sp)]
    outs_b = [o for _ in range(4) for o in plain.generate(ids, sp)]
    drafts, tokens, accepted = counts(eng)
    assert drafts > 0 and 0 < accepted < tokens  # drafts both accepted and rejected
    for pos in (1, 2, 3):
        a = Counter(o.token_ids[pos] for o in outs_a)
        b = Counter(o.token_ids[pos] for o in outs_b)
        assert len(a | b) >= 2
        assert _chi2_p(a, b) > 1e-3, (pos, a, b)


def test_ngram_index_points_into_the_past() -> None:
    idx = NgramIndex((3, 2))
    ids = [1, 2, 3, 4, 5, 1, 2, 3]
    assert idx.lookup(ids, 3) == [4, 5, 1]  # after the earlier "1 2 3"
    ids += [9]
    assert idx.lookup(ids, 2) == []  # "3 9" and "2 3 9" never occurred before
    ids += [4, 5]
    assert idx.lookup(ids, 4) == [1, 2, 3, 9]  # latest earlier "4 5"
    assert NgramIndex((2,)).lookup([7, 7], 2) == []  # the suffix itself is no match


def test_adaptive_policy_speculates_only_where_it_pays() -> None:
    pol = AdaptivePolicy(max_k=4, max_batch=64)
    cheap = SpecState(alpha=0.7)
    assert pol.plan(cheap, "ngram") == 4  # nothing measured yet: drafts look free
    for rows, ms in [(1, 7.7), (5, 10.1), (2, 8.3), (16, 24.0), (20, 27.0), (4, 9.5)] * 3:
        pol.observe_step(rows, ms / 1e3)  # a decode step: ~7 ms + ~1 ms per row
    t0, t1 = pol.steps.line()
    assert 5e-3 < t0 < 8e-3 and 5e-4 < t1 < 1.5e-3
    assert pol.plan(SpecState(alpha=0.7), "ngram", batch=1) >= 3  # free drafts at batch 1: long runs
    big = SpecState(alpha=0.7)
    assert pol.plan(big, "ngram", batch=32) == 0 and big.pause == 4  # at 32 rows the verify rows cost too much
    pol.observe_pass("self", 6e-3)  # a draft pass costs most of a target step
    poor = SpecState(alpha=0.4)
    assert pol.plan(poor, "self") == 0 and poor.pause == 4  # 1.4 tokens for ~1.9 steps: no
    assert [pol.plan(poor, "self") for _ in range(4)] == [0, 0, 0, 0]
    assert pol.plan(poor, "self") == 1  # the pause is over: probe one round
    pol.update(poor, "self", 1, 0)
    assert pol.plan(poor, "self") == 0 and poor.pause == 8  # still no: twice as long
    assert pol.plan(SpecState(alpha=0.97), "self") == 0  # a draft as slow as the model never pays
    pol.observe_pass("draft", 1.5e-3)  # a small draft model
    assert pol.plan(SpecState(alpha=0.9), "draft") >= 2  # good guesses at a fifth of the cost pay
    for _ in range(20):
        pol.update(SpecState(alpha=0.0), "self", 4, 0)
    assert pol.state(type("R", (), {"spec": None})(), "self").alpha < 0.3  # new requests start from the record
    assert pol.step_allows(64) and not pol.step_allows(65)
    assert expected_tokens(1.0, 3) == 4 and expected_tokens(0.5, 1) == pytest.approx(1.5)


@pytest.mark.slow
def test_adaptive_off_switch_keeps_random_work_from_slowing(make_engine: Any, plain: Any) -> None:
    """A draft that guesses badly for its cost (this tiny model's first 20 layers on free text)
    is measured in the first rounds, then paused: a few probes, not a draft every step."""
    eng = make_engine(kernels="optimized", kv_cache_tokens=16384, speculative="self:20")
    ids = chat(plain, PROMPTS[2])
    sp = SamplingParams(max_tokens=96, temperature=0, ignore_eos=True)
    out = eng.generate(ids, sp)[0]
    assert out.token_ids == plain.generate(ids, sp)[0].token_ids
    drafts, tokens, accepted = counts(eng)
    assert accepted < tokens / 2  # it does guess badly
    assert 0 < drafts <= 8  # measured, then paused (drafting every step: ~70 rounds)
    # The next request (its prefill a step with nobody decoding) starts paused: the proposer's
    # record says it does not pay.
    again = eng.generate(ids, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0]
    assert again.token_ids == out.token_ids[:24]
    assert counts(eng)[0] == drafts
