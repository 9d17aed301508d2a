"""SamplingParams validation: absurd values are refused with a message naming the field."""

from __future__ import annotations

import math

import pytest

from tripod.engine.request import FinishReason, Req, SamplingParams

BAD_VALUES = [
    ("max_tokens", 0),
    ("max_tokens", -3),
    ("max_tokens", 1.5),
    ("temperature", -0.5),
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("temperature", 101.0),
    ("temperature", 2.01),  # the server's bound and the engine's are one: [0, 2]
    ("temperature", "1.0"),
    ("top_p", 0.0),
    ("top_p", 1.01),
    ("top_p", -0.2),
    ("top_p", math.nan),
    ("top_k", -2),
    ("top_k", 2.5),
    ("min_p", -0.1),
    ("min_p", 1.5),
    ("min_p", math.nan),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", 10.5),
    ("repetition_penalty", math.inf),
    ("frequency_penalty", 2.5),
    ("frequency_penalty", -2.01),
    ("frequency_penalty", math.nan),
    ("presence_penalty", -3.0),
    ("presence_penalty", 2.01),
    ("seed", 1.5),
    ("seed", "42"),
    ("logprobs", 21),
    ("logprobs", -1),
    ("logprobs", 2.0),
    ("n", 0),
    ("n", -1),
    ("n", 129),
    ("stop_token_ids", [1, -2]),
    ("stop_token_ids", [1.0]),
    ("priority", 1.5),
    # bool is an int in Python, but a boolean here is a caller's mistake, not the number 1.
    ("max_tokens", True),
    ("logprobs", True),
    ("n", True),
    ("top_k", True),
    ("seed", False),
    ("stop_token_ids", [True]),
    ("temperature", True),
    ("logit_bias", {5: 100.5}),
    ("logit_bias", {5: -101}),
    ("logit_bias", {-1: 1.0}),
    ("logit_bias", {"5": 1.0}),
    ("logit_bias", {5: math.nan}),
    ("logit_bias", [5, 1.0]),
    ("prompt_logprobs", 21),
    ("prompt_logprobs", -1),
    ("prompt_logprobs", True),
]


@pytest.mark.parametrize(("field", "value"), BAD_VALUES, ids=[f"{f}={v!r}" for f, v in BAD_VALUES])
def test_absurd_value_raises_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError) as exc:
        SamplingParams(**{field: value})  # type: ignore[arg-type]
    msg = str(exc.value)
    assert msg.startswith(field), msg
    assert repr(value) in msg, "the message shows the offending value"


GOOD_EDGES = [
    ("max_tokens", 1),
    ("temperature", 0.0),
    ("temperature", 2.0),
    ("temperature", 1),  # an int is a number
    ("top_p", 1.0),
    ("top_p", 1e-9),
    ("top_k", -1),
    ("top_k", 0),
    ("top_k", 1),
    ("min_p", 0.0),
    ("min_p", 1.0),
    ("repetition_penalty", 10.0),
    ("frequency_penalty", -2.0),
    ("presence_penalty", 2.0),
    ("seed", 0),
    ("seed", 2**70),
    ("logprobs", 0),
    ("logprobs", 20),
    ("n", 128),
    ("priority", -5),
    ("logit_bias", {5: 100.0, 7: -100.0}),
    ("logit_bias", {}),
    ("prompt_logprobs", 0),
    ("prompt_logprobs", 20),
]


@pytest.mark.parametrize(("field", "value"), GOOD_EDGES, ids=[f"{f}={v!r}" for f, v in GOOD_EDGES])
def test_edge_values_are_accepted(field: str, value: object) -> None:
    p = SamplingParams(**{field: value})  # type: ignore[arg-type]
    assert getattr(p, field) == value


def test_greedy_and_penalty_flags() -> None:
    assert SamplingParams(temperature=0.0).greedy
    assert not SamplingParams(temperature=0.5).greedy
    assert not SamplingParams().needs_penalties
    assert SamplingParams(repetition_penalty=1.1).needs_penalties
    assert SamplingParams(frequency_penalty=0.1).needs_penalties
    assert SamplingParams(presence_penalty=-0.1).needs_penalties


def test_req_ids_and_lengths() -> None:
    a = Req(prompt_ids=[1, 2, 3], params=SamplingParams())
    b = Req(prompt_ids=[4], params=SamplingParams(), rid="mine")
    assert a.rid and a.rid != b.rid and b.rid == "mine"
    assert b.seq > a.seq
    a.output_ids.extend([7, 8])
    assert a.all_ids == [1, 2, 3, 7, 8] and a.seq_len == 5
    assert a.prompt_ids == [1, 2, 3], "all_ids does not alias the prompt"
    assert not a.finished
    a.finish_reason = FinishReason.LENGTH
    assert a.finished
