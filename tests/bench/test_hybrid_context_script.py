"""``benchmarks/hybrid_context.py`` on a tiny setting: the files it writes and their structure (no
timing is asserted), and, slow, its agentic part against real ``tripod serve`` processes, where
every later turn of a session that extends its conversation exactly is cached whole."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import hybrid_context

TINY = ["--hidden", "32", "--layers", "4", "--heads", "2", "--kv-heads", "1", "--head-dim", "16",
        "--decode", "3", "--reps", "1", "--chunk-size", "64"]


def test_decode_part_writes_the_results_plot_and_memory_accounting(tmp_path: Path) -> None:
    assert hybrid_context.main([*TINY, "--contexts", "40,100", "--sessions", "0", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "hybrid_context.json").read_text())
    assert {"date", "command", "cpu", "load_before", "load_after", "peers"} <= data.keys()
    rows = {(r["model"], r["context"]): r for r in data["decode"]}
    assert set(rows) == {(m, c) for m in ("hybrid", "full") for c in (40, 100)}
    for (model, ctx), r in rows.items():
        assert r["kv_bytes"] == r["kv_bytes_per_token"] * (ctx + 3)
        assert r["bytes_per_sequence"] == r["kv_bytes"] + r["state_bytes"]
        assert (r["state_bytes"] > 0) == (model == "hybrid")
    # one attention layer of four keeps K/V: a quarter of the full-attention model's bytes per token
    assert rows[("hybrid", 40)]["kv_bytes_per_token"] * 4 == rows[("full", 40)]["kv_bytes_per_token"]
    md = (tmp_path / "hybrid_context.md").read_text()
    assert "## Decode TPOT and memory per sequence" in md and "## Peers" in md and "not run" in md
    assert "| 100 |" in md and data["command"] in md
    assert (tmp_path / "hybrid_context.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_agentic_part_reuses_the_whole_previous_conversation(tmp_path: Path) -> None:
    assert hybrid_context.main([*TINY, "--skip-decode", "--sessions", "1", "--turns", "3", "--agentic-scale", "0.02",
                                "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "hybrid_context.json").read_text())
    runs = {a["label"]: a["agentic"] for a in data["agentic"]}
    assert set(runs) == {"cache-on", "cache-off"}
    on, off = runs["cache-on"], runs["cache-off"]
    assert on["reuse"]["later_turns"] == 2 and on["reuse"]["whole_previous"] == 2
    assert off["reuse"]["whole_previous"] == 0 and off["cache_hit_rate"] == 0.0
    assert "TTFT p50 of later turns" in (tmp_path / "hybrid_context.md").read_text()
    assert not (tmp_path / "hybrid_context.png").exists()  # no decode part, no plot
