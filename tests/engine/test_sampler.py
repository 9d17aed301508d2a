"""Sampler on hand-made logits: filters, distributions, seeds, penalties and logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from tripod.engine.request import Req, SamplingParams
from tripod.engine.sampler import Sampler, noise_key, position_key, seeded_noise, seeded_uniform

CPU = torch.device("cpu")
LOGITS = torch.tensor([1.0, 3.0, 0.5, 2.5, -1.0])  # argmax 1, runner-up 3
VOCAB = LOGITS.numel()


def _req(prompt: list[int] | None = None, seed: int | None = None, **params: object) -> Req:
    p = SamplingParams(seed=seed, **params)  # type: ignore[arg-type]
    return Req(prompt_ids=prompt or [0], params=p, noise_key=noise_key(seed) if seed is not None else None)


def _decode(sampler: Sampler, logits: torch.Tensor, reqs: list[Req], row: int) -> int:
    """One decoding step as the engine takes it: sample, then append each row's token to its
    request's output (a seeded request's noise is that of its next output position)."""
    toks = sampler.sample(logits, reqs).token_ids
    for r, t in zip(reqs, toks, strict=True):
        r.output_ids.append(t)
    return toks[row]


def _draws(req: Req, n: int, logits: torch.Tensor = LOGITS, seed: int = 0) -> list[int]:
    """``n`` independent draws for ``req`` in one batch (one row per draw)."""
    sampler = Sampler(CPU, seed=seed)
    return sampler.sample(logits.expand(n, -1).clone(), [req] * n).token_ids


def _counts(tokens: list[int], vocab: int = VOCAB) -> list[int]:
    return torch.bincount(torch.tensor(tokens), minlength=vocab).tolist()


def _chi_square(counts: list[int], probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs, strict=True) if p > 0)


# Critical value of chi-square with 4 degrees of freedom at p = 0.001.
_CHI2_4DOF_999 = 18.47


def test_greedy_takes_the_argmax() -> None:
    logits = torch.tensor([[0.1, 0.2, 5.0, 0.3], [9.0, 0.0, -1.0, 8.9], [-3.0, -2.0, -1.0, -0.5]])
    reqs = [_req(temperature=0.0) for _ in range(3)]
    assert Sampler(CPU).sample(logits, reqs).token_ids == [2, 0, 3]


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 1.0, "top_k": 1},
        {"temperature": 1.5, "top_p": 1e-6},
        {"temperature": 1.0, "min_p": 1.0},
    ],
    ids=["top_k=1", "top_p tiny", "min_p=1"],
)
def test_filters_that_leave_one_token_equal_greedy(params: dict[str, float]) -> None:
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(0))
    greedy = logits.argmax(dim=-1).tolist()
    req = _req(**params)
    assert Sampler(CPU, seed=1).sample(logits, [req] * 64).token_ids == greedy


def test_temperature_sampling_matches_softmax() -> None:
    temp = 1.7
    n = 20_000
    counts = _counts(_draws(_req(temperature=temp), n))
    probs = torch.softmax(LOGITS / temp, dim=-1).tolist()
    assert _chi_square(counts, probs) < _CHI2_4DOF_999, (counts, probs)


def test_low_temperature_sharpens() -> None:
    # At T = 0.1 the argmax (3.0 vs 2.5: 5 nats apart after scaling) takes >99 % of draws.
    counts = _counts(_draws(_req(temperature=0.1), 5000))
    assert counts[1] / 5000 > 0.99


def test_top_k_samples_only_the_top_k_in_proportion() -> None:
    n = 20_000
    counts = _counts(_draws(_req(temperature=1.0, top_k=2), n))
    assert counts[0] == counts[2] == counts[4] == 0
    p = torch.softmax(LOGITS[[1, 3]], dim=-1).tolist()
    assert _chi_square([counts[1], counts[3]], p) < 10.83  # 1 dof, p = 0.001


def test_top_p_keeps_the_smallest_head_reaching_p() -> None:
    probs = torch.softmax(LOGITS, dim=-1)
    # Sorted: 1 (0.50), 3 (0.30), 0 (0.09), 2 (0.07), 4 (0.02) roughly; 0.7 needs tokens 1 and 3.
    assert probs[1] < 0.7 < probs[1] + probs[3]
    counts = _counts(_draws(_req(temperature=1.0, top_p=0.7), 20_000))
    assert counts[0] == counts[2] == counts[4] == 0
    p = (probs[[1, 3]] / probs[[1, 3]].sum()).tolist()
    assert _chi_square([counts[1], counts[3]], p) < 10.83


def test_min_p_never_picks_a_token_below_threshold() -> None:
    min_p = 0.2
    probs = torch.softmax(LOGITS, dim=-1)
    allowed = {i for i in range(VOCAB) if probs[i] >= min_p * probs.max()}
    assert 1 < len(allowed) < VOCAB  # the threshold really cuts something and keeps a choice
    draws = _draws(_req(temperature=1.0, min_p=min_p), 20_000)
    assert set(draws) == allowed


def test_seeded_request_draws_the_same_alone_or_in_a_batch() -> None:
    logits = torch.randn(1, 32, generator=torch.Generator().manual_seed(3))
    steps = 40

    alone = _req(seed=1234, temperature=1.0)
    s1 = Sampler(CPU, seed=0)
    solo = [_decode(s1, logits, [alone], 0) for _ in range(steps)]

    mine = _req(seed=1234, temperature=1.0)
    others = [
        _req(temperature=0.7),  # unseeded: draws from the sampler's generator
        _req(seed=99, temperature=1.3, top_k=5),
        _req(temperature=0.0),
        _req(temperature=1.0, top_p=0.5, min_p=0.1),
    ]
    batch_logits = torch.cat([torch.randn(2, 32), logits, torch.randn(2, 32)])
    s2 = Sampler(CPU, seed=7)  # a different fallback seed must not matter for seeded rows
    batched: list[int] = []
    for _ in range(steps):
        rows = [others[0], others[1], mine, others[2], others[3]]
        batched.append(_decode(s2, batch_logits, rows, 2))
    assert batched == solo
    assert len(set(solo)) > 3, "the draws really are random, not a fixed token"


def test_different_seeds_draw_differently() -> None:
    logits = torch.zeros(1, 1000)
    r1, r2 = _req(seed=1), _req(seed=2)
    s = Sampler(CPU)
    a = [_decode(s, logits, [r1], 0) for _ in range(5)]
    b = [_decode(s, logits, [r2], 0) for _ in range(5)]
    assert a != b


def test_seeded_noise_is_a_function_of_seed_copy_and_position_only() -> None:
    """Counter-based: the draw at output position k is the same whatever came before it, so a
    continuation that starts at k (prior output given as tokens) draws what the original would."""
    logits = torch.randn(1, 64, generator=torch.Generator().manual_seed(5))
    full = _req(seed=77, temperature=1.0)
    s = Sampler(CPU, seed=3)
    ref = [_decode(s, logits, [full], 0) for _ in range(30)]
    for k in (1, 13, 29):
        cont = _req(seed=77, temperature=1.0)
        cont.output_ids = list(ref[:k])  # what a continuation at k carries
        other = Sampler(CPU, seed=99)
        other.sample(torch.randn(3, 64), [_req(temperature=1.0)] * 3)  # unrelated draws in between
        assert [_decode(other, logits, [cont], 0) for _ in range(30 - k)] == ref[k:]
    # The row is the key's alone: reproducible, different per copy and per position.
    a = seeded_noise([position_key(noise_key(5), 3)], 1000, CPU)
    assert torch.equal(a, seeded_noise([position_key(noise_key(5), 3)], 1000, CPU))
    assert not torch.equal(a, seeded_noise([position_key(noise_key(5, copy=1), 3)], 1000, CPU))
    assert not torch.equal(a, seeded_noise([position_key(noise_key(5), 4)], 1000, CPU))
    # Seeds beyond 64 bits and negative seeds are folded, not rejected.
    seeded_noise([position_key(noise_key(-3 + 2**70), 0)], 8, CPU)


def test_seeded_uniforms_are_uniform_and_independent() -> None:
    keys = [position_key(noise_key(seed), k) for seed in range(4) for k in range(50)]
    u = seeded_uniform(keys, 4096, CPU)
    assert float(u.min()) > 0.0 and float(u.max()) < 1.0
    # 200 rows x 4096: deciles equally filled (chi-square, 9 dof, p = 0.001: 27.88) ...
    counts = torch.bincount((u * 10).long().flatten(), minlength=10).tolist()
    assert _chi_square(counts, [0.1] * 10) < 27.88, counts
    # ... and no correlation between neighbouring positions or neighbouring vocabulary entries.
    assert abs(float(torch.corrcoef(torch.stack([u[:-1].flatten(), u[1:].flatten()]))[0, 1])) < 0.01
    assert abs(float(torch.corrcoef(torch.stack([u[:, :-1].flatten(), u[:, 1:].flatten()]))[0, 1])) < 0.01


def test_seeded_sampling_across_positions_matches_softmax() -> None:
    """A seeded sequence's draws over its positions follow the distribution (the noise is random
    enough as a sampler, not only reproducible)."""
    temp = 1.3
    req = _req(seed=2024, temperature=temp)
    s = Sampler(CPU)
    draws = [_decode(s, LOGITS.unsqueeze(0), [req], 0) for _ in range(6000)]
    probs = torch.softmax(LOGITS / temp, dim=-1).tolist()
    assert _chi_square(_counts(draws), probs) < _CHI2_4DOF_999


# ---------------------------------------------------------------- penalties


def _penalised_logprobs(req: Req, logits: torch.Tensor) -> torch.Tensor:
    """The sampler's log-softmax of the penalised logits, read back through logprobs."""
    req.params.logprobs = logits.numel()
    res = Sampler(CPU).sample(logits.unsqueeze(0).clone(), [req])
    lp = res.logprobs[0]
    assert lp is not None
    out = torch.empty(logits.numel())
    for tok, v in lp.top:
        out[tok] = v
    return out


def test_repetition_penalty_divides_positive_and_multiplies_negative() -> None:
    logits = torch.tensor([2.0, -2.0, 1.0, -1.0, 0.5, 3.0])
    # Seen: 0 and 1 in the prompt, 2 in the output (once is enough), 3 in both.
    req = _req(prompt=[0, 1, 3], temperature=0.0, repetition_penalty=2.0)
    req.output_ids = [2, 3, 2]
    expected = torch.tensor([1.0, -4.0, 0.5, -2.0, 0.5, 3.0])
    got = _penalised_logprobs(req, logits)
    torch.testing.assert_close(got, torch.log_softmax(expected, dim=-1))


def test_frequency_and_presence_penalties_use_output_counts_only() -> None:
    logits = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0])
    # Token 4 is only in the prompt: OpenAI penalties ignore the prompt.
    req = _req(prompt=[4, 4, 4], temperature=0.0, frequency_penalty=0.5, presence_penalty=0.25)
    req.output_ids = [0, 0, 0, 1, 2, 0]  # counts: 0 -> 4, 1 -> 1, 2 -> 1
    expected = logits - torch.tensor([0.5 * 4 + 0.25, 0.5 * 1 + 0.25, 0.5 * 1 + 0.25, 0.0, 0.0])
    got = _penalised_logprobs(req, logits)
    torch.testing.assert_close(got, torch.log_softmax(expected, dim=-1))


def test_negative_frequency_penalty_encourages_repeats() -> None:
    logits = torch.tensor([1.0, 2.0, 0.0])
    req = _req(temperature=0.0, frequency_penalty=-2.0)
    req.output_ids = [2, 2]  # 0.0 + 2 * 2.0 = 4.0 beats token 1's 2.0
    assert Sampler(CPU).sample(logits.unsqueeze(0), [req]).token_ids == [2]


def test_penalties_do_not_touch_other_rows_or_the_input() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0], [2.0, 1.0, 0.0]])
    keep = logits.clone()
    penalised = _req(prompt=[0], temperature=0.0, repetition_penalty=10.0)
    plain = _req(prompt=[0], temperature=0.0)
    res = Sampler(CPU).sample(logits, [penalised, plain])
    assert res.token_ids == [1, 0]
    assert torch.equal(logits, keep), "the caller's logits are not modified"


# ---------------------------------------------------------------- logprobs


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logprobs_of_chosen_and_top_tokens(temperature: float) -> None:
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(11))
    k = 5
    reqs = [_req(temperature=temperature, logprobs=k) for _ in range(6)]
    res = Sampler(CPU).sample(logits, reqs)
    ref = torch.log_softmax(logits, dim=-1)
    for row, (tok, lp) in enumerate(zip(res.token_ids, res.logprobs, strict=True)):
        assert lp is not None
        assert lp.token_id == tok
        assert math.isclose(lp.logprob, float(ref[row, tok]), rel_tol=1e-5, abs_tol=1e-6)
        assert len(lp.top) == k
        vals = [v for _, v in lp.top]
        assert vals == sorted(vals, reverse=True)
        best = ref[row].topk(k)
        assert [t for t, _ in lp.top] == best.indices.tolist()
        torch.testing.assert_close(torch.tensor(vals), best.values)


def test_logprobs_zero_gives_chosen_only_and_none_when_not_asked() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0], [0.0, 1.0, 2.0]])
    res = Sampler(CPU).sample(logits, [_req(temperature=0.0, logprobs=0), _req(temperature=0.0)])
    lp0 = res.logprobs[0]
    assert lp0 is not None and lp0.top == [] and lp0.token_id == 2
    assert math.isclose(lp0.logprob, float(torch.log_softmax(logits[0], dim=-1)[2]), rel_tol=1e-6)
    assert res.logprobs[1] is None


def test_mask_forbids_tokens() -> None:
    logits = torch.tensor([[5.0, 1.0, 0.0, 4.0]])
    mask = torch.tensor([[False, True, True, True]])
    assert Sampler(CPU).sample(logits, [_req(temperature=0.0)], masks=mask).token_ids == [3]
    draws = (
        Sampler(CPU)
        .sample(
            logits.expand(2000, -1).clone(),
            [_req(temperature=1.0)] * 2000,
            masks=mask.expand(2000, -1),
        )
        .token_ids
    )
    assert 0 not in draws


@pytest.mark.parametrize("top_p", [1e-300, 1e-46, 1e-7])
def test_a_top_p_below_float32s_range_still_keeps_the_best_token(top_p: float) -> None:
    """A top_p that rounds to 0 in float32 (the fuzzer sent 1.8e-256) keeps the first token, as
    any top_p does: with the other tokens masked (a grammar), the draw is the one allowed token,
    never an index of probability 0."""
    logits = torch.full((4, VOCAB), float("-inf"))
    logits[:, 3] = 0.5  # the only token a grammar allows
    logits[1, 2] = 0.0
    reqs = [_req(top_p=top_p), _req(top_p=top_p, seed=5), _req(top_p=top_p, repetition_penalty=2.5),
            _req(top_p=top_p, min_p=0.5)]
    for seed in range(20):
        assert Sampler(CPU, seed=seed).sample(logits.clone(), reqs).token_ids == [3, 3, 3, 3]


def test_the_race_never_picks_a_token_of_probability_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    """An Exp(1) draw of exactly 0 (possible in float32) made p / E NaN for p = 0, and argmax takes
    NaN: the noise is kept above 0."""
    probs = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    real = torch.Tensor.exponential_

    def zero_first(t: torch.Tensor, *a: object, **k: object) -> torch.Tensor:
        real(t, *a, **k)
        return t.index_fill_(-1, torch.tensor([0]), 0.0)

    monkeypatch.setattr(torch.Tensor, "exponential_", zero_first)
    assert Sampler(CPU).race(probs, [_req()]).tolist() == [2]
