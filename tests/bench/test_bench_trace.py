"""``tripod bench --dataset trace``: the trace file format, the replay (offsets honoured, outputs as
long as recorded) against a fake server in process, and one real replay on the embedded model."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from tripod.bench.client import Target
from tripod.bench.runner import trace_replay
from tripod.bench.trace import load_trace
from tripod.cli import main as tripod_main

SESSION = [
    {"offset": 0.0, "session": "s1", "output_tokens": 6, "messages": [{"role": "user", "content": "Name a river."}]},
    {"offset": 0.15, "prompt": "Once upon a time", "output_tokens": 4, "response": "(recorded answer: ignored)"},
    {"offset": 0.3, "session": "s2", "output_tokens": 9, "messages": [{"role": "user", "content": "Hi"}]},
    {"offset": 0.3, "session": "s3", "output_tokens": 3, "messages": [{"role": "user", "content": "Yo"}]},
    {"offset": 0.6, "session": "s1", "output_tokens": 5, "messages": [
        {"role": "user", "content": "Name a river."}, {"role": "assistant", "content": "The Nile."},
        {"role": "user", "content": "Another one?"}]},
]


def _write(path: Path, records: list[Any], header: str = "# recorded 2026-11-30\n\n") -> Path:
    path.write_text(header + "\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n")
    return path


def test_trace_file_format(tmp_path: Path) -> None:
    shuffled = [SESSION[4], SESSION[0], SESSION[2], SESSION[1], SESSION[3]]
    reqs = load_trace(_write(tmp_path / "t.jsonl", shuffled))
    assert [r.offset for r in reqs] == [0.0, 0.15, 0.3, 0.3, 0.6]  # sent in offset order
    assert [r.session for r in reqs][2:4] == ["s2", "s3"]  # equal offsets keep the file's order
    assert [r.max_tokens for r in reqs] == [6, 4, 9, 3, 5]
    assert all(r.extra == {"ignore_eos": True} for r in reqs)
    assert reqs[1].prompt == "Once upon a time" and reqs[1].messages is None
    assert reqs[4].messages is not None and [m["role"] for m in reqs[4].messages] == ["user", "assistant", "user"]

    def error(*lines: Any) -> str:
        with pytest.raises(ValueError) as e:
            load_trace(_write(tmp_path / "bad.jsonl", list(lines), header=""))
        return str(e.value)

    ok = {"offset": 0, "prompt": "x", "output_tokens": 1}
    assert re.search(r"bad\.jsonl:2: output_tokens: Field required", error(ok, {"offset": 1, "prompt": "x"}))
    assert ":1: give exactly one of 'messages'" in error({**ok, "messages": [{"role": "user", "content": "y"}]})
    assert ":1: give exactly one" in error({"offset": 0, "output_tokens": 3})
    assert ":1: offset: Input should be greater than or equal to 0" in error({**ok, "offset": -1})
    assert ":1: output_tokens: Input should be greater than or equal to 1" in error({**ok, "output_tokens": 0})
    assert ":2: not JSON" in error(ok, "{oops")
    assert ":1: each line must be a JSON object" in error("[1, 2]")
    assert "no requests in it" in error()
    with pytest.raises(ValueError, match="cannot read it"):
        load_trace(tmp_path / "missing.jsonl")


class FakeModel:
    """An OpenAI-compatible streaming endpoint in process: each answer takes ``latency`` s, and
    stops by itself after 2 tokens unless ``ignore_eos`` (then it runs to ``max_tokens``; 50 when
    there is none)."""

    def __init__(self, latency: float) -> None:
        self.latency = latency
        self.bodies: list[dict[str, Any]] = []

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.bodies.append(body)
        limit = body.get("max_tokens") or 50
        n = limit if body.get("ignore_eos") else min(2, limit)
        chat = request.url.path.endswith("/chat/completions")

        async def events() -> Any:
            await asyncio.sleep(self.latency)
            for i in range(n):
                choice = {"index": 0, "delta": {"content": f"t{i} "}} if chat else {"index": 0, "text": f"t{i} "}
                yield f"data: {json.dumps({'choices': [choice]})}\n\n".encode()
            usage = {"prompt_tokens": 5, "completion_tokens": n, "prompt_tokens_details": {"cached_tokens": 0}}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode()
            yield b"data: [DONE]\n\n"

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=events())


def test_replay_honours_offsets_and_recorded_lengths(tmp_path: Path) -> None:
    reqs = load_trace(_write(tmp_path / "t.jsonl", SESSION))
    fake = FakeModel(latency=0.25)  # longer than the gaps: requests overlap, as recorded

    level = asyncio.run(trace_replay(Target("http://fake", "fake"), reqs, max_duration=30, timeout=10,
                                     transport=httpx.MockTransport(fake)))
    assert not level.interrupted and len(level.results) == len(SESSION)
    assert all(r.ok for r in level.results), [r.error for r in level.results]
    # Each request left at its offset after the replay's start (measured from the recorded send
    # times), never before it, whatever was still in flight.
    sent = sorted(r.start - level.started for r in level.results)
    for got, want in zip(sent, [0.0, 0.15, 0.3, 0.3, 0.6], strict=True):
        assert want - 0.005 <= got <= want + 0.1, (sent, want)
    # Outputs capped as recorded: max_tokens = the recorded length, with ignore_eos, so the fake
    # (which would stop after 2 tokens) answers with exactly that many.
    assert sorted(b["max_tokens"] for b in fake.bodies) == sorted(r["output_tokens"] for r in SESSION)
    assert all(b["ignore_eos"] is True and b["stream"] is True for b in fake.bodies)
    assert sorted(r.output_tokens for r in level.results) == sorted(r["output_tokens"] for r in SESSION)
    turn2 = next(b for b in fake.bodies if len(b.get("messages", [])) == 3)
    assert turn2["messages"][1] == {"role": "assistant", "content": "The Nile."}  # history as recorded
    assert sum("prompt" in b for b in fake.bodies) == 1
    # The duration runs from the first send to the last answer (offset 0.6 + 0.25 s of latency).
    assert 0.85 <= level.duration < 2.0


def test_replay_stops_at_max_duration(tmp_path: Path) -> None:
    reqs = load_trace(_write(tmp_path / "t.jsonl", [{**SESSION[0], "offset": 0.0}, {**SESSION[1], "offset": 30.0}]))
    level = asyncio.run(trace_replay(Target("http://fake", "fake"), reqs, max_duration=0.5, timeout=10,
                                     transport=httpx.MockTransport(FakeModel(latency=0.0))))
    assert len(level.results) == 1  # the request at 30 s lies beyond the limit: never sent


def test_cli_refuses_a_trace_without_its_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert tripod_main(["bench", "--base-url", "http://127.0.0.1:9", "--dataset", "trace"]) == 2
    assert "--trace FILE" in capsys.readouterr().err
    assert tripod_main(["bench", "--base-url", "http://127.0.0.1:9", "--trace", "x.jsonl"]) == 2
    assert "--dataset trace" in capsys.readouterr().err
    assert tripod_main(["bench", "--base-url", "http://127.0.0.1:9", "--dataset", "trace", "--trace",
                        str(tmp_path / "none.jsonl")]) == 2
    assert "cannot read it" in capsys.readouterr().err
    assert tripod_main(["bench", "--base-url", "http://127.0.0.1:9", "--cost-per-hour", "-1"]) == 2
    assert "--cost-per-hour" in capsys.readouterr().err


def _metric(text: str, name: str) -> float:
    m = re.search(name + r"\{[^}]*\} ([0-9.e+]+)", text)
    return float(m.group(1)) if m else 0.0


def test_replay_against_the_embedded_model(server: Any, tmp_path: Path) -> None:
    """A recorded two-turn session and a completion replayed on a real server: every answer exactly
    as long as recorded, the server's own token count moved by as much, cost in the report."""
    trace = _write(tmp_path / "session.jsonl", [SESSION[0], SESSION[1], SESSION[4]])
    before = httpx.get(f"{server.url}/metrics").text
    out = tmp_path / "bench"
    r = subprocess.run([sys.executable, "-m", "tripod.cli", "bench", "--base-url", f"{server.url},label=tripod",
                        "--dataset", "trace", "--trace", str(trace), "--cost-per-hour", "2.5", "--machines", "2",
                        "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    after = httpx.get(f"{server.url}/metrics").text
    (run,) = json.loads((out / "results.json").read_text())["runs"]
    assert run["mode"] == "trace" and run["dataset"] == "trace" and run["concurrency"] is None
    assert run["completed"] == 3 and run["failed"] == 0
    assert run["output_tokens"] == 6 + 4 + 5
    assert _metric(after, "tripod:generation_tokens_total") - _metric(before, "tripod:generation_tokens_total") == 15
    assert run["cost_per_million_output_tokens"] == pytest.approx(2.5 * 2 / (run["output_throughput"] * 3600) * 1e6)
    assert run["cached_token_share"] > 0  # the second turn re-sends the first: found in the prefix cache
    assert "cost_per_million_output_tokens" in (out / "results.csv").read_text().splitlines()[0]
    assert "trace:" in r.stderr and "per M output tokens" in r.stderr
