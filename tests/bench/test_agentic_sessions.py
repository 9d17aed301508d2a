"""``--dataset agentic-sessions``: growing sessions with salts, the trace round trip, the per-turn
summary (goodput by session) and the TTFT-by-turn plot, on a stand-in tokenizer (one token a word)."""

from __future__ import annotations

from itertools import pairwise
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
    for a, b in pairwise(reqs):
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
