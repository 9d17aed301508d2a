"""The console's benchmark history: finding runs, and flagging a run slower than the one before it
beyond the noise of both (tripod/console/history.py). No server, no model."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.support.bench_fixtures import write_run
from tripod.bench.metrics import RequestResult, cost_per_million, relative_noise, summarize
from tripod.console.bench_runs import bench_index, read_run
from tripod.console.history import (
    DEFAULT_NOISE,
    NOISE_FLOOR,
    Z,
    build_history,
    noise_from_percentiles,
)
from tripod.console.models import HistorySeries


def _series(root: Path) -> list[HistorySeries]:
    idx = bench_index(str(root))
    assert not idx.skipped, idx.skipped
    return idx.history


def test_single_run_is_a_series_of_one_point_with_nothing_to_compare(tmp_path: Path) -> None:
    write_run(tmp_path / "day0", "2026-11-01T10:00:00", decode_rate=50.0)
    (s,) = _series(tmp_path)
    (p,) = s.points
    assert p.run == "day0" and p.change is None and p.previous is None and not p.slower and not p.ttft_worse
    assert s.key.concurrency == 4 and s.key.isl == 64 and s.key.dataset == "random" and "C=4" in s.label


def test_equal_runs_are_not_flagged(tmp_path: Path) -> None:
    for day, started in (("day0", "2026-11-01T09:00:00"), ("day1", "2026-11-02T09:00:00")):
        write_run(tmp_path / day, started, decode_rate=50.0)  # the same timings (same seed): the same speed
    (s,) = _series(tmp_path)
    assert [p.run for p in s.points] == ["day0", "day1"]
    p = s.points[1]
    assert p.change == pytest.approx(0.0) and p.previous == "day0" and not p.slower and not p.ttft_worse


def test_a_clearly_slower_run_is_flagged_with_its_threshold(tmp_path: Path) -> None:
    write_run(tmp_path / "day0", "2026-11-01T10:00:00", decode_rate=50.0, ttft=0.2)
    write_run(tmp_path / "day1", "2026-11-02T10:00:00", decode_rate=35.0, ttft=0.3, seed=1)
    (s,) = _series(tmp_path)
    before, after = s.points
    assert after.slower and after.ttft_worse
    assert after.change == pytest.approx(after.output_throughput / before.output_throughput - 1)
    assert after.change < -0.25
    # Fixed-length synthetic requests with a 5 % spread over 40 requests: below the floor, so the
    # threshold is the floor's: Z·√2·2 %.
    assert after.noise_measured and after.throughput_noise == NOISE_FLOOR
    assert after.threshold == pytest.approx(Z * math.hypot(NOISE_FLOOR, NOISE_FLOOR))


def test_a_small_drop_within_the_noise_is_not_flagged(tmp_path: Path) -> None:
    write_run(tmp_path / "day0", "2026-11-01T10:00:00", decode_rate=50.0)
    write_run(tmp_path / "day1", "2026-11-02T10:00:00", decode_rate=49.0)  # 2 % slower
    (s,) = _series(tmp_path)
    p = s.points[1]
    assert -0.04 < p.change < 0 and not p.slower


def test_the_runs_own_spread_sets_the_noise(tmp_path: Path) -> None:
    """The same 12 % drop: flagged between two tight runs, not between two noisy ones."""
    for name, spread, n in (("tight", 0.05, 40), ("noisy", 0.6, 8)):
        write_run(tmp_path / name / "a", "2026-11-01T10:00:00", decode_rate=50.0, spread=spread, n=n, target=name)
        write_run(tmp_path / name / "b", "2026-11-02T10:00:00", decode_rate=44.0, spread=spread, n=n, target=name)
    series = {s.key.target: s for s in _series(tmp_path)}
    tight, noisy = series["tight"].points[1], series["noisy"].points[1]
    assert tight.change == pytest.approx(noisy.change, abs=0.1) and tight.change < -0.05
    assert tight.slower and not noisy.slower
    assert noisy.throughput_noise > 0.1 and noisy.threshold > abs(noisy.change)


def test_each_run_is_compared_with_the_previous_one_at_the_same_settings(tmp_path: Path) -> None:
    write_run(tmp_path / "a", "2026-11-01T10:00:00", decode_rate=50.0)
    write_run(tmp_path / "b", "2026-11-02T10:00:00", decode_rate=30.0)  # the regression
    write_run(tmp_path / "c", "2026-11-03T10:00:00", decode_rate=30.0)  # as slow as b: not a new one
    write_run(tmp_path / "other", "2026-11-04T10:00:00", decode_rate=10.0, isl=512)  # other settings
    write_run(tmp_path / "d", "2026-11-05T10:00:00", decode_rate=52.0)  # faster again
    series = {s.key.isl: s for s in _series(tmp_path)}
    assert set(series) == {64, 512}
    pts = series[64].points
    assert [p.run for p in pts] == ["a", "b", "c", "d"]
    assert [p.slower for p in pts] == [False, True, False, False]
    assert [p.previous for p in pts] == [None, "a", "b", "c"]
    (only,) = series[512].points  # a different isl is never compared with the others
    assert only.previous is None and not only.slower


def test_missing_settings_and_empty_levels(tmp_path: Path) -> None:
    """A results.json without options compares only with others without them; a level where
    nothing completed is left out; several levels of one run give one series each."""
    write_run(tmp_path / "a", "2026-11-01T10:00:00", decode_rate=50.0, levels=[1, 4])
    write_run(tmp_path / "b", "2026-11-02T10:00:00", decode_rate=20.0, levels=[1, 4])
    bare = tmp_path / "bare"
    data = write_run(bare, "2026-11-03T10:00:00", decode_rate=5.0)
    del data["config"]["options"]
    data["runs"].append({**data["runs"][0], "concurrency": 8, "completed": 0, "output_throughput": 0.0})
    (bare / "results.json").write_text(json.dumps(data))
    series = {(s.key.concurrency, s.key.isl): s for s in _series(tmp_path)}
    assert set(series) == {(1, 64), (4, 64), (4, None)}
    assert all(s.points[-1].slower for k, s in series.items() if k[1] == 64)
    (p,) = series[(4, None)].points
    assert p.run == "bare" and p.previous is None and not p.slower


def test_noise_when_a_run_did_not_record_it() -> None:
    # From percentiles (results.json written before bench recorded its noise): normal p90 − p50 = 1.28 sd.
    assert noise_from_percentiles(100.0, 100.0 + 1.2816 * 20.0, 25) == pytest.approx(0.2 / 5)
    assert noise_from_percentiles(100.0, 120.0, 1) is None and noise_from_percentiles(None, 1.0, 9) is None
    from tripod.console.models import BenchLevel, BenchRun

    def run(name: str, tput: float, noise: float | None) -> BenchRun:
        lv = BenchLevel(target="t", mode="closed", dataset="random", concurrency=1, request_rate=None, completed=10,
                        failed=0, output_throughput=tput, output_throughput_per_machine=tput, interactivity=None,
                        ttft_p50_ms=None, ttft_p99_ms=None, tpot_p50_ms=None, output_throughput_rel_noise=noise)
        return BenchRun(id=name, started=float(len(name)), started_text="", model=None, machines=1,
                        cost_per_hour=None, targets=["t"], levels=[lv])

    # Unknown noise: the default (5 %) per run → threshold 2·√2·5 % ≈ 14 %.
    (s,) = build_history([run("a", 100.0, None), run("bb", 88.0, None)])
    p = s.points[1]
    assert not p.noise_measured and p.throughput_noise == DEFAULT_NOISE and not p.slower
    (s,) = build_history([run("a", 100.0, None), run("bb", 80.0, None)])
    assert s.points[1].slower
    assert s.points[1].ttft_change is None and not s.points[1].ttft_worse  # no TTFT recorded: no TTFT flag


def test_discovery_skips_what_is_not_a_run(tmp_path: Path) -> None:
    write_run(tmp_path / "nightly" / "2026-11-01", "2026-11-01T10:00:00", decode_rate=50.0)
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "results.json").write_text("{not json")
    (tmp_path / "cmp").mkdir()
    (tmp_path / "cmp" / "results.json").write_text(json.dumps({"config": {"compare": []}, "runs": []}))
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".hidden" / "results.json").write_text("{}")
    idx = bench_index(str(tmp_path))
    assert [r.id for r in idx.runs] == ["nightly/2026-11-01"]
    assert {s.path: s.why.split(":")[0] for s in idx.skipped} == {
        "broken/results.json": "not JSON", "cmp/results.json": "a 'tripod bench compare' overlay, not a run"}
    assert bench_index(str(tmp_path / "nope")).message.endswith("is not a directory")
    assert "--bench-dir" in (bench_index(None).message or "")
    run = read_run(tmp_path / "nightly" / "2026-11-01" / "results.json", tmp_path)
    assert run.started_text == "2026-11-01 10:00" and run.targets == ["tripod"] and run.levels[0].completed == 40


def test_bench_records_noise_and_cost() -> None:
    assert relative_noise([1.0]) is None and relative_noise([0.0, 0.0]) is None
    # mean 2, sd 1 (n − 1), n = 3: 1 / 2 / √3
    assert relative_noise([1.0, 2.0, 3.0]) == pytest.approx(0.5 / math.sqrt(3))
    # 2 machines at $3/h = $6/h; 1000 tok/s = 3.6 M tokens/h → $1.667 per M
    assert cost_per_million(3.0, 2, 1000.0) == pytest.approx(6.0 / 3.6)
    assert cost_per_million(None, 1, 1000.0) is None and cost_per_million(3.0, 1, 0.0) is None
    rs = [RequestResult(start=0, ttft=0.1, e2e=1.1, output_tokens=11), RequestResult(start=0, ttft=0.3, e2e=2.3,
                                                                                       output_tokens=11)]
    s = summarize(rs, 2.0, cost_per_hour=1.8, machines=1)
    # decode rates 10 and 5 tok/s: mean 7.5, sd 3.536 → 0.4714 / √2; TTFT 0.1 and 0.3: 0.1414 / 0.2 / √2
    assert s["noise"]["output_throughput"] == pytest.approx(3.5355 / 7.5 / math.sqrt(2), rel=1e-3)
    assert s["noise"]["ttft"] == pytest.approx(0.14142 / 0.2 / math.sqrt(2), rel=1e-3) and s["noise"]["n"] == 2
    assert s["cost_per_million_output_tokens"] == pytest.approx(1.8 / (11.0 * 3600) * 1e6)
