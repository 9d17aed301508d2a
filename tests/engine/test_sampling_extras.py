"""``logit_bias`` and prompt logprobs on the real embedded model, and ``SamplingParams`` crossing
the process boundary as a typed message."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from tripod.engine.request import GrammarSpec, Resume, SamplingParams
from tripod.protocol import engine_ipc

PROMPT = "The capital of France is Paris. The capital of Germany is"


def test_logit_bias_bans_and_forces(engine: Any) -> None:
    ids = engine.encode(PROMPT)
    base = engine.generate(ids, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    first = base.token_ids[0]
    banned = engine.generate(ids, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                 logit_bias={first: -100}))[0]
    assert banned.token_ids[0] != first and first not in banned.token_ids
    forced = engine.generate(ids, SamplingParams(temperature=0.8, seed=1, max_tokens=5, logit_bias={42: 100}))[0]
    assert forced.token_ids == [42] * 5
    # A bias is added to the logits: +5 on the runner-up changes the greedy pick exactly when
    # its logprob gap to the top is below 5.
    top = engine.generate(ids, SamplingParams(temperature=0, max_tokens=1, logprobs=2))[0].logprobs[0].top
    (t0, l0), (t1, l1) = top
    nudged = engine.generate(ids, SamplingParams(temperature=0, max_tokens=1, logit_bias={t1: (l0 - l1) + 0.01}))[0]
    assert nudged.token_ids == [t1]
    held = engine.generate(ids, SamplingParams(temperature=0, max_tokens=1, logit_bias={t1: (l0 - l1) - 0.01}))[0]
    assert held.token_ids == [t0]


def test_logit_bias_never_breaks_a_grammar(engine: Any) -> None:
    ids = engine.encode("Answer yes or no:")
    yes = engine.encode(" maybe")[0]
    out = engine.generate(ids, SamplingParams(temperature=0, max_tokens=5, logit_bias={yes: 100},
                                              grammar=GrammarSpec("choice", '["yes", "no"]')))[0]
    assert out.text in ("yes", "no")


def test_prompt_logprobs_score_the_prompt(engine: Any, make_engine: Any) -> None:
    """Scoring prompt + greedy continuation gives the continuation's own logprobs back, chunked
    or not, and top-k alternatives best first."""
    ids = engine.encode(PROMPT)
    gen = engine.generate(ids, SamplingParams(temperature=0, max_tokens=8, logprobs=2, ignore_eos=True))[0]
    full = ids + gen.token_ids
    out = engine.generate(full, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3))[0]
    pl = out.prompt_logprobs
    assert pl is not None and len(pl) == len(full) and pl[0] is None
    for j, lp in enumerate(gen.logprobs):
        p = pl[len(ids) + j]
        assert p.token_id == gen.token_ids[j]
        assert p.logprob == pytest.approx(lp.logprob, abs=1e-4)
        assert p.top[0][0] == lp.top[0][0]
    for i, p in enumerate(pl[1:], 1):
        assert p.token_id == full[i] and p.logprob <= 0 and len(p.top) == 3
        assert [v for _, v in p.top] == sorted((v for _, v in p.top), reverse=True)
        assert p.top[0][1] >= p.logprob - 1e-5
    # Chunked (8-token chunks) and with n = 2: the same numbers, for every copy.
    small = make_engine(chunk_size=8)
    outs = small.generate(full, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0, n=2))
    for o in outs:
        assert o.prompt_logprobs is not None and o.prompt_logprobs[0] is None
        for a, b in zip(pl[1:], o.prompt_logprobs[1:], strict=True):
            assert b.top == [] and b.logprob == pytest.approx(a.logprob, abs=1e-4)
    small.assert_consistent()


def test_prompt_logprobs_match_the_reference(engine: Any, hf_model: Any) -> None:
    ids = engine.encode("Water boils at 100 degrees Celsius at sea level.")
    out = engine.generate(ids, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))[0]
    with torch.inference_mode():
        ref = torch.log_softmax(hf_model(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)
    assert out.prompt_logprobs is not None
    for i in range(1, len(ids)):
        assert out.prompt_logprobs[i].logprob == pytest.approx(float(ref[i - 1, ids[i]]), abs=2e-3)


def test_prompt_logprobs_in_a_stream_come_first(engine: Any) -> None:
    ids = engine.encode(PROMPT)
    deltas = list(engine.stream(ids, SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=0)))
    assert deltas[0].prompt_logprobs is not None and len(deltas[0].prompt_logprobs) == len(ids)
    assert all(d.prompt_logprobs is None for d in deltas[1:])


def test_bounds_are_one_set() -> None:
    """The server's translation and the engine accept the same values (one validation)."""
    from tripod.server.api.sampling import build_sampling
    from tripod.server.errors import APIError
    from tripod.server.state import Limits

    lim = Limits(max_len=100, max_n=4, vocab_size=1000)
    for temp, ok in ((2.0, True), (2.0001, False), (0.0, True), (-1e-9, False)):
        try:
            build_sampling(lim, prompt_len=5, max_tokens=3, default_max_tokens=10, temperature=temp)
            server_ok = True
        except APIError:
            server_ok = False
        try:
            SamplingParams(temperature=temp)
            engine_ok = True
        except ValueError:
            engine_ok = False
        assert server_ok == engine_ok == ok
    with pytest.raises(APIError, match="'top_logprobs' must be an integer between 0 and 20") as e:
        build_sampling(lim, prompt_len=5, max_tokens=3, default_max_tokens=10, logprobs=21,
                       names={"logprobs": "top_logprobs"})
    assert e.value.param == "top_logprobs"
    with pytest.raises(APIError, match=r"token ids in \[0, 1000\)"):
        build_sampling(lim, prompt_len=5, max_tokens=3, default_max_tokens=10, logit_bias={1000: 1.0})


def test_add_request_crosses_the_boundary_typed() -> None:
    p = SamplingParams(max_tokens=7, temperature=0.5, top_k=3, seed=2**62, logprobs=2, stop_token_ids=[4],
                       n=2, priority=-1, grammar=GrammarSpec("regex", r"\d+"), logit_bias={5: -100.0, 9: 2.5},
                       prompt_logprobs=1)
    msg = engine_ipc.decode(engine_ipc.encode(engine_ipc.AddRequest("r1", [1, 2, 3], p)))
    assert isinstance(msg, engine_ipc.AddRequest) and isinstance(msg.params, SamplingParams)
    assert msg.params == p and msg.prompt_ids == [1, 2, 3] and msg.resume == []
    # A continuation carries the copies it resumes, typed.
    cont = engine_ipc.decode(engine_ipc.encode(engine_ipc.AddRequest("r1", [1], p, [Resume(1, (7, 8))])))
    assert cont.resume == [Resume(1, (7, 8))]
    bad = engine_ipc.encode(engine_ipc.AddRequest("r2", [1], SamplingParams(n=3)))
    # Tamper with the wire copy: a value out of bounds is refused on the engine side, with what
    # a rejection needs (the id and the number of copies).
    import msgspec

    wire = msgspec.msgpack.decode(bad)
    wire["params"]["temperature"] = math.inf
    with pytest.raises(engine_ipc.InvalidAddRequest) as e:
        engine_ipc.decode(msgspec.msgpack.encode(wire))
    assert e.value.rid == "r2" and e.value.n == 3 and "temperature" in str(e.value)
