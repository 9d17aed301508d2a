"""``tripod bench --dataset agentic-sessions``: multi-turn agent sessions, as a coding agent sends them.

Each of N sessions runs T turns one after another (the runner keeps a session on one worker; the
concurrency is sessions in flight). Turn 0 sends a system prompt with tool schemas (2-8k tokens)
and a user message; every later turn sends the **whole history** again plus either a tool result
(0.2-4k tokens, odd turns) or a new user message (even turns); the history holds the earlier
answers (50-400 tokens) as generated here, so a session needs no server answer to build its next
turn and the server's prefix cache sees exactly the prefixes a real agent's would. Between turns
the session waits a think time (exponential, ``--think-time`` mean seconds: the tool running, the
user reading). Every session starts with its own salt (``[user <seed>-<n>]``), so sessions never
share a prefix by accident. ``--agentic-scale`` multiplies every length (0.1 for a small model's
context).

A run can be written as a trace (``--write-trace FILE``: JSON lines, ``bench/trace.py``'s format
plus ``turn`` and ``think_time``) and a recorded trace replayed as sessions
(``--dataset agentic-sessions --trace FILE``: each session's turns in order, its think times kept).

Reported per run (``runs[].agentic`` in results.json): TTFT p50/p99 by turn index, TPOT p50/p99,
the prefix-cache hit rate (``cached_tokens`` / prompt tokens, where the server reports it), and
goodput: sessions whose every turn met the SLO (``--slo ttft=...,tpot=...``), per minute and as a
share; ``ttft_by_turn.svg`` draws TTFT by turn for every run.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tripod.bench.datasets import BenchRequest, TextMaker
from tripod.bench.metrics import RequestResult, meets_slo, percentile

AGENTIC_SESSIONS = "agentic-sessions"


@dataclass(frozen=True, slots=True)
class SessionShape:
    """Token-length ranges (uniform, inclusive) of one session's parts, before ``scale``."""

    system: tuple[int, int] = (2000, 8000)
    tool_output: tuple[int, int] = (200, 4000)
    user: tuple[int, int] = (20, 200)
    answer: tuple[int, int] = (50, 400)
    scale: float = 1.0

    def draw(self, rng: random.Random, part: tuple[int, int]) -> int:
        lo, hi = (max(1, round(x * self.scale)) for x in part)
        return rng.randint(lo, hi)


_TOOLS = ("read_file(path)", "write_file(path, text)", "run_tests(pattern)", "grep(pattern, path)",
          "list_dir(path)", "apply_patch(diff)")


def make_sessions(count: int, tokenizer: Any, *, turns: int, think_time: float, seed: int,
                  shape: SessionShape = SessionShape(), echo: bool = False) -> list[BenchRequest]:
    """``count`` turns of ⌈count / turns⌉ sessions, in session order.

    ``echo``: each turn as token ids (the system prompt and first message on turn 0, the new
    message alone later) that ``extends`` its previous turn: the runner prepends the previous
    prompt and the server's answer (``runner.extend_turn``), so no generated answer is used."""
    rng = random.Random(seed)
    mk = TextMaker(tokenizer, rng)
    out: list[BenchRequest] = []
    for s in range(max(1, -(-count // turns))):
        tools = "Tools: " + "; ".join(_TOOLS) + ". Answer with a tool call or a final answer.\n"
        history: list[dict[str, str]] = [
            {"role": "system", "content": mk.text(shape.draw(rng, shape.system), lead=f"[user {seed}-{s}] {tools}")}]
        for t in range(turns):
            if len(out) >= count:
                break
            if t % 2:
                msg = f"Tool result {t}: " + mk.text(shape.draw(rng, shape.tool_output))
            else:
                msg = f"User {t}: " + mk.text(shape.draw(rng, shape.user))
            history = [*history, {"role": "user", "content": msg}]
            think = rng.expovariate(1 / think_time) if think_time > 0 and t else 0.0
            if echo:
                text = (history[0]["content"] + "\n" if t == 0 else "\n") + msg + "\n"
                out.append(BenchRequest(shape.draw(rng, shape.answer), prompt_ids=tokenizer.encode(
                    text, add_special_tokens=False), extends=t > 0, session=f"a{seed}-{s}", turn=t,
                    think_time=think, extra={"ignore_eos": True}))
                continue
            out.append(BenchRequest(shape.draw(rng, shape.answer), messages=history, session=f"a{seed}-{s}", turn=t,
                                    think_time=think, extra={"ignore_eos": True}))
            history = [*history, {"role": "assistant", "content": mk.text(shape.draw(rng, shape.answer))}]
    return out


def write_trace(path: str | Path, requests: list[BenchRequest]) -> None:
    """``requests`` as a trace file (one JSON object per line, offsets 0: sessions run closed-loop)."""
    with open(path, "w") as f:
        for r in requests:
            f.write(json.dumps({"offset": 0.0, "session": r.session, "turn": r.turn, "think_time": r.think_time,
                                "output_tokens": r.max_tokens, "messages": r.messages}) + "\n")


def load_sessions(path: str | Path) -> list[BenchRequest]:
    """A trace replayed as sessions: each session's turns in ``turn`` order, think times kept, no
    offsets (each turn goes when its session's previous one is answered and the think time passed)."""
    from tripod.bench.trace import load_trace

    reqs = load_trace(path)
    raw = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip() and not line.startswith("#")]
    for r, line in zip(reqs, sorted(raw, key=lambda d: d["offset"]), strict=True):
        r.turn, r.think_time, r.offset = int(line.get("turn", 0)), float(line.get("think_time", 0.0)), None
        r.session = r.session or f"line-{id(r)}"
    return sorted(reqs, key=lambda r: (str(r.session), r.turn))


def _ms(xs: list[float]) -> dict[str, float | None]:
    return {"p50": percentile([x * 1e3 for x in xs], 50) if xs else None,
            "p99": percentile([x * 1e3 for x in xs], 99) if xs else None}


def summary(results: list[RequestResult], duration: float, slo_ttft: float | None,
            slo_tpot: float | None) -> dict[str, Any]:
    """Per-turn TTFT, TPOT, cache hit rate and session goodput of one run (see the module docstring)."""
    by_turn: dict[int, list[float]] = {}
    sessions: dict[str, list[RequestResult]] = {}
    for r in results:
        sessions.setdefault(r.session or "", []).append(r)
        if r.ok and r.ttft is not None:
            by_turn.setdefault(r.turn, []).append(r.ttft)
    ok = [r for r in results if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    by_turn_reuse, reuse = _reuse(sessions)
    good = [s for s, turns in sessions.items() if all(t.ok and meets_slo(t, slo_ttft, slo_tpot) for t in turns)]
    return {
        "sessions": len(sessions),
        "ttft_ms_by_turn": {str(t): {**_ms(v), "n": len(v)} for t, v in sorted(by_turn.items())},
        "tpot_ms": _ms([t for r in ok if (t := r.tpot) is not None]),
        "cache_hit_rate": sum(r.cached_tokens for r in ok) / prompt if prompt else 0.0,
        "cached_tokens_by_turn": {str(t): v["cached_mean"] for t, v in by_turn_reuse.items()},
        "reuse_by_turn": by_turn_reuse,
        "reuse": reuse,
        "sessions_within_slo": len(good),
        "session_goodput_share": len(good) / len(sessions) if sessions else 0.0,
        "session_goodput_per_min": len(good) / max(duration, 1e-9) * 60.0,
    }


def _reuse(sessions: dict[str, list[RequestResult]]) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """How much of the previous conversation each later turn found cached: per turn index, the mean
    ``cached_tokens`` and the mean previous prompt + answer, and over all later turns how many were
    cached whole. "Whole" allows one token short: the answer's last token was sampled, never run
    through the model, so no server has its KV or state (meaningful where a turn extends the
    previous one exactly: ``--agentic-echo``)."""
    rows: dict[int, list[tuple[int, int]]] = {}
    for turns in sessions.values():
        done = {r.turn: r for r in turns}
        for r in turns:
            prev = done.get(r.turn - 1)
            if r.turn > 0 and r.ok and prev is not None and prev.ok:
                rows.setdefault(r.turn, []).append((r.cached_tokens, prev.prompt_tokens + prev.output_tokens))
    by_turn = {str(t): {"n": len(v), "cached_mean": round(sum(c for c, _ in v) / len(v), 1),
                        "previous_mean": round(sum(p for _, p in v) / len(v), 1),
                        "whole_previous": sum(c >= p - 1 for c, p in v)} for t, v in sorted(rows.items())}
    flat = [x for v in rows.values() for x in v]
    total_prev = sum(p for _, p in flat)
    return by_turn, {"later_turns": len(flat), "whole_previous": sum(c >= p - 1 for c, p in flat),
                     "cached_share_of_previous": sum(c for c, _ in flat) / total_prev if total_prev else 0.0}


def plot_ttft_by_turn(out: Path, runs: list[dict[str, Any]]) -> Path | None:
    """``out/ttft_by_turn.svg``: TTFT p50 (solid) and p99 (dashed) by turn, one colour per run."""
    series = [(f"{r['target']} C={r.get('concurrency')}", r["agentic"]["ttft_ms_by_turn"]) for r in runs if "agentic" in r]
    if not series:
        return None
    turns = sorted({int(t) for _, s in series for t in s})
    top = max((v["p99"] or 0.0) for _, s in series for v in s.values()) or 1.0
    w, h, pad = 640, 360, 50
    x = lambda t: pad + (w - 2 * pad) * (t - turns[0]) / max(1, turns[-1] - turns[0])  # noqa: E731
    y = lambda v: h - pad - (h - 2 * pad) * v / top  # noqa: E731
    colours = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="11">',
             f'<text x="{w / 2}" y="16" text-anchor="middle">TTFT by turn (ms; solid p50, dashed p99; top {top:.0f} ms)</text>',
             f'<line x1="{pad}" y1="{h - pad}" x2="{w - pad}" y2="{h - pad}" stroke="black"/>',
             f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{h - pad}" stroke="black"/>']
    parts += [f'<text x="{x(t)}" y="{h - pad + 14}" text-anchor="middle">{t}</text>' for t in turns]
    for i, (label, s) in enumerate(series):
        c = colours[i % len(colours)]
        for key, dash in (("p50", ""), ("p99", ' stroke-dasharray="4 3"')):
            pts = " ".join(f"{x(int(t)):.1f},{y(v[key]):.1f}" for t, v in sorted(s.items(), key=lambda kv: int(kv[0]))
                           if v[key] is not None)
            parts.append(f'<polyline fill="none" stroke="{c}" stroke-width="2"{dash} points="{pts}"/>')
        parts.append(f'<text x="{w - pad - 150}" y="{pad + 14 * i}" fill="{c}">{label}</text>')
    parts.append("</svg>")
    path = out / "ttft_by_turn.svg"
    path.write_text("\n".join(parts))
    return path
