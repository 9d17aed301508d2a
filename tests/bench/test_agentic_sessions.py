"""``--dataset agentic-sessions``: growing sessions with salts, the trace round trip, the per-turn
summary (goodput by session) and the TTFT-by-turn plot, on a stand-in tokenizer (one token a word)."""

from __future__ import annotations

import itertools
from pathlib import Path

from tripod.bench import agentic
from tripod.bench.metrics import RequestResult


class _Words:
    def encode(self, text: str, add_special_tokens: bool = False) -> list[str]:
        return text.split()

    def decode(self, ids: list[str]) -> str:
        return " ".join(ids)


SHAPE = agentic.SessionShape(scale=0.05)


def test_sessions_grow_turn_by_turn_and_never_share_a_prefix() -> None:
    reqs = agentic.make_sessions(12, _Words(), turns=4, think_time=2.0, seed=3, shape=SHAPE)
    assert len(reqs) == 12 and len({r.session for r in reqs}) == 3
    for a, b in itertools.pairwise(reqs):
        if a.session == b.session:
            assert b.turn == a.turn + 1 and b.messages[: len(a.messages)] == a.messages  # the whole history again
            assert b.messages[len(a.messages)]["role"] == "assistant" and b.think_time > 0
    firsts = [r for r in reqs if r.turn == 0]
    assert len({r.messages[0]["content"].split("]")[0] for r in firsts}) == 3  # a salt per session
    assert all(r.messages[0]["role"] == "system" and "Tools:" in r.messages[0]["content"] for r in firsts)
    assert reqs[1].messages[-1]["content"].startswith("Tool result 1:")
    lo, hi = (round(x * 0.05) for x in agentic.SessionShape().system)
    assert all(lo <= len(r.messages[0]["content"].split()) - 12 <= hi + 2 for r in firsts)


def test_trace_round_trip_replays_as_sessions(tmp_path: Path) -> None:
    reqs = agentic.make_sessions(6, _Words(), turns=3, think_time=1.0, seed=1, shape=SHAPE)
    path = tmp_path / "sessions.jsonl"
    agentic.write_trace(path, reqs)
    back = agentic.load_sessions(path)
    key = lambda r: (r.session, r.turn)  # noqa: E731
    assert [(key(r), r.messages, r.max_tokens, r.think_time) for r in sorted(back, key=key)] == \
           [(key(r), r.messages, r.max_tokens, r.think_time) for r in sorted(reqs, key=key)]
    assert all(r.offset is None for r in back)


def test_summary_by_turn_hit_rate_goodput_and_plot(tmp_path: Path) -> None:
    def res(session: str, turn: int, ttft: float, cached: int) -> RequestResult:
        return RequestResult(start=0.0, ttft=ttft, e2e=ttft + 1.0, output_tokens=11, prompt_tokens=100,
                             cached_tokens=cached, session=session, turn=turn)

    results = [res("a", 0, 0.5, 0), res("a", 1, 0.2, 90), res("b", 0, 0.6, 0), res("b", 1, 3.0, 90)]
    s = agentic.summary(results, duration=60.0, slo_ttft=1.0, slo_tpot=None)
    assert s["sessions"] == 2 and s["sessions_within_slo"] == 1 and s["session_goodput_share"] == 0.5
    assert s["ttft_ms_by_turn"]["0"]["p50"] == 550.0 and s["ttft_ms_by_turn"]["1"]["n"] == 2
    assert s["cache_hit_rate"] == 180 / 400 and s["tpot_ms"]["p50"] == 100.0
    assert s["session_goodput_per_min"] == 1.0
    svg = agentic.plot_ttft_by_turn(tmp_path, [{"target": "tripod", "concurrency": 2, "agentic": s}])
    assert svg is not None and "<polyline" in svg.read_text()


class _Ids:
    """A stand-in tokenizer with integer ids: one id per word (its index of first appearance)."""

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [self.vocab.setdefault(w, len(self.vocab)) for w in text.split()]

    def decode(self, ids: list[int]) -> str:
        words = {i: w for w, i in self.vocab.items()}
        return " ".join(words[i] for i in ids)


def test_echo_sessions_extend_the_servers_own_conversation_token_for_token() -> None:
    from tripod.bench.client import Target, request_body
    from tripod.bench.runner import extend_turn

    tok = _Ids()
    reqs = agentic.make_sessions(6, tok, turns=3, think_time=0.0, seed=2, shape=SHAPE, echo=True)
    assert [r.turn for r in reqs] == [0, 1, 2, 0, 1, 2] and all(r.messages is None for r in reqs)
    assert [r.extends for r in reqs] == [False, True, True, False, True, True]
    assert "Tools:" in tok.decode(reqs[0].prompt_ids) and tok.decode(reqs[1].prompt_ids).startswith("Tool result 1:")
    # turn 0 goes as it is; turn 1 carries turn 0's ids, the server's answer, then its own message
    first = extend_turn(reqs[0], None)
    assert first is reqs[0]
    answer = RequestResult(start=0.0, ttft=0.1, e2e=0.2, output_tokens=3, output_ids=[901, 902, 903], session="x")
    sent = extend_turn(reqs[1], (first, answer))
    assert not isinstance(sent, str) and not sent.extends
    assert sent.prompt_ids == [*reqs[0].prompt_ids, 901, 902, 903, *reqs[1].prompt_ids]
    path, body = request_body(Target("http://x", "t"), sent)
    assert path == "/v1/completions" and body["prompt"] == sent.prompt_ids and body["return_token_ids"] is True
    assert body["return_tokens"] is True and body["verbose"] is True  # llama.cpp's names
    assert body["max_tokens"] == sent.max_tokens and body["ignore_eos"] is True
    # an answer without its ids (a server without return_token_ids), or a failed turn: not sent
    assert extend_turn(reqs[1], (first, RequestResult(start=0.0, ttft=0.1, output_tokens=3))) == "no_token_ids"
    assert extend_turn(reqs[1], (first, RequestResult(start=0.0, error="http_500"))) == "previous_turn_failed"
    assert extend_turn(reqs[1], None) == "previous_turn_failed"


def test_stream_chunks_collect_the_answers_token_ids() -> None:
    from tripod.bench.client import _record_chunk

    res = RequestResult(start=0.0)
    last, n = _record_chunk(res, {"choices": [{"text": "a", "token_ids": [5, 6]}]}, 1.0, None, 0)
    last, n = _record_chunk(res, {"choices": [{"text": "b", "token_ids": [7]}]}, 2.0, last, n)
    assert res.output_ids == [5, 6, 7] and n == 2
    # llama.cpp (``return_tokens`` + ``verbose``): a token per partial chunk under ``__verbose``; its
    # last chunk's list is empty when streaming (or the whole answer: then it stands)
    res = RequestResult(start=0.0)
    last, n = _record_chunk(res, {"choices": [{"text": "a"}], "__verbose": {"stop": False, "tokens": [5]}}, 1.0, None, 0)
    last, n = _record_chunk(res, {"choices": [{"text": "b"}], "__verbose": {"stop": False, "tokens": [6]}}, 2.0, last, n)
    last, n = _record_chunk(res, {"choices": [{"text": "", "finish_reason": "length"}],
                                  "__verbose": {"stop": True, "tokens": []}}, 3.0, last, n)
    assert res.output_ids == [5, 6] and n == 2
    _record_chunk(res, {"choices": [], "__verbose": {"stop": True, "tokens": [5, 6, 7]}}, 4.0, last, n)
    assert res.output_ids == [5, 6, 7]


def test_reuse_counts_later_turns_cached_whole() -> None:
    def res(session: str, turn: int, prompt: int, out: int, cached: int) -> RequestResult:
        return RequestResult(start=0.0, ttft=0.1, e2e=1.0, output_tokens=out, prompt_tokens=prompt,
                             cached_tokens=cached, session=session, turn=turn)

    # a: turn 1 has all of turn 0's 100 + 10 tokens but the last sampled one; turn 2 only 50 of 130
    # b: turn 1 cached whole; c: its turn 0 failed, so its turn 1 is not counted
    failed = RequestResult(start=0.0, error="timeout", session="c", turn=0)
    results = [res("a", 0, 100, 10, 0), res("a", 1, 120, 10, 109), res("a", 2, 150, 10, 50),
               res("b", 0, 40, 5, 0), res("b", 1, 60, 5, 45), failed, res("c", 1, 30, 5, 0)]
    s = agentic.summary(results, duration=10.0, slo_ttft=None, slo_tpot=None)
    assert s["reuse"]["later_turns"] == 3 and s["reuse"]["whole_previous"] == 2
    assert s["reuse"]["cached_share_of_previous"] == (109 + 50 + 45) / (110 + 130 + 45)
    assert s["reuse_by_turn"]["1"] == {"n": 2, "cached_mean": 77.0, "previous_mean": 77.5, "whole_previous": 2}
    assert s["reuse_by_turn"]["2"]["whole_previous"] == 0 and s["cached_tokens_by_turn"]["2"] == 50.0
