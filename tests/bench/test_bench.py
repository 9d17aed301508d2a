"""`tripod bench`: metrics against hand-computed values, datasets, and a real run end to end."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from tripod.bench.datasets import make_requests
from tripod.bench.main import parse_slo, parse_target
from tripod.bench.metrics import RequestResult, percentile, summarize


def test_percentile_interpolates_between_ranks() -> None:
    assert percentile([4, 1, 3, 2], 50) == 2.5
    assert percentile([1, 2, 3, 4], 90) == pytest.approx(3.7)
    assert percentile([1, 2, 3, 4], 99) == pytest.approx(3.97)
    assert percentile([7], 99) == 7
    assert math.isnan(percentile([], 50))


def _recorded() -> list[RequestResult]:
    return [
        RequestResult(start=0.0, ttft=0.1, e2e=1.1, itl=[0.1] * 10, output_tokens=11, prompt_tokens=100, cached_tokens=50),
        RequestResult(start=0.5, ttft=0.2, e2e=2.2, itl=[0.1] * 20, output_tokens=21, prompt_tokens=100),
        RequestResult(start=1.0, ttft=0.3, e2e=0.3, output_tokens=1, prompt_tokens=100, cached_tokens=100),
        RequestResult(start=1.5, error="http_429"),
    ]


def test_summary_matches_hand_computed_values() -> None:
    s = summarize(_recorded(), 4.0)
    assert (s["completed"], s["failed"], s["errors"]) == (3, 1, {"http_429": 1})
    assert (s["input_tokens"], s["output_tokens"]) == (300, 33)
    assert s["request_throughput"] == pytest.approx(0.75)
    assert s["output_throughput"] == pytest.approx(8.25)
    assert s["input_throughput"] == pytest.approx(75.0)
    assert s["total_throughput"] == pytest.approx(83.25)
    assert s["ttft_ms"]["mean"] == pytest.approx(200.0)
    assert s["ttft_ms"]["p50"] == pytest.approx(200.0)
    assert s["ttft_ms"]["p90"] == pytest.approx(280.0)  # sorted 100,200,300: rank 1.8
    assert s["ttft_ms"]["p99"] == pytest.approx(298.0)
    # TPOT = (E2E - TTFT) / (out - 1): 1.0/10 and 2.0/20; the 1-token request has none.
    assert s["tpot_ms"]["mean"] == pytest.approx(100.0) and s["tpot_ms"]["p99"] == pytest.approx(100.0)
    assert s["itl_ms"]["p50"] == pytest.approx(100.0) and s["itl_ms"]["mean"] == pytest.approx(100.0)
    assert s["e2e_ms"]["mean"] == pytest.approx(1200.0)
    assert s["interactivity"] == pytest.approx(10.0)  # 1 / 0.1 s
    assert s["cached_token_share"] == pytest.approx(0.5)  # 150 of 300
    assert s["goodput"] == pytest.approx(0.75)  # no SLO: every completed request counts


def test_goodput_counts_requests_meeting_every_slo() -> None:
    assert summarize(_recorded(), 4.0, slo_ttft=0.25)["goodput"] == pytest.approx(0.5)  # 2 of 4 s
    assert summarize(_recorded(), 4.0, slo_tpot=0.05)["goodput"] == pytest.approx(0.25)  # only the 1-token one
    assert summarize(_recorded(), 4.0, slo_ttft=0.25, slo_tpot=0.05)["goodput"] == 0.0
    assert summarize(_recorded(), 4.0, machines=2)["output_throughput_per_machine"] == pytest.approx(4.125)


def test_session_metric_is_p90_of_e2e_per_output_token() -> None:
    rs = [
        RequestResult(start=0, ttft=0.1, e2e=1.0, output_tokens=10, session="a"),
        RequestResult(start=1, ttft=0.1, e2e=2.0, output_tokens=10, session="a"),
        RequestResult(start=0, ttft=0.1, e2e=1.0, output_tokens=20, session="b"),
    ]
    # a: 3.0 s / 20 tokens = 150 ms; b: 50 ms; p90 of [50, 150] = 140
    assert summarize(rs, 3.0)["session_p90_ms_per_token"] == pytest.approx(140.0)


def test_option_parsing() -> None:
    t = parse_target("http://h:1/,label=vllm,model=m", None)
    assert (t.base_url, t.label, t.model) == ("http://h:1", "vllm", "m")
    assert parse_target("http://h:1", "k").label == "http://h:1"
    with pytest.raises(ValueError):
        parse_target("http://h:1,colour=red", None)
    assert parse_slo("ttft=2000,tpot=50") == (2.0, 0.05)
    with pytest.raises(ValueError):
        parse_slo("latency=3")


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from tripod.loader import load_tokenizer

    return load_tokenizer(None).tokenizer


def test_datasets(tokenizer: Any) -> None:
    rnd = make_requests("random", 6, tokenizer, isl=64, osl=16, seed=1)
    lens = [len(tokenizer.encode(r.prompt, add_special_tokens=False)) for r in rnd]
    assert all(abs(n - 64) <= 2 for n in lens), lens
    assert len({r.prompt[:20] for r in rnd}) == 6 and all(r.max_tokens == 16 for r in rnd)
    assert make_requests("random", 3, tokenizer, isl=64, seed=1)[0].prompt == rnd[0].prompt  # seeded
    ranged = make_requests("random", 40, tokenizer, isl=100, osl=100, range_ratio=0.5, seed=2)
    assert min(r.max_tokens for r in ranged) >= 50 and max(r.max_tokens for r in ranged) <= 150
    assert len({r.max_tokens for r in ranged}) > 5
    sp = make_requests("shared-prefix", 8, tokenizer, isl=16, prefix_len=200, num_groups=2)
    heads = {r.prompt.split("\n")[0] for r in sp if r.prompt}
    assert len(heads) == 2
    ag = make_requests("agentic", 8, tokenizer, isl=16, osl=8, turns=4, prefix_len=64, think_time=0.5)
    by_session: dict[str, list[Any]] = {}
    for r in ag:
        by_session.setdefault(r.session or "", []).append(r)
    assert len(by_session) == 2
    for turns in by_session.values():
        sizes = [len(r.messages or []) for r in turns]
        assert sizes == sorted(sizes) and sizes[0] < sizes[-1]  # the context grows turn by turn
    st = make_requests("structured", 3, tokenizer, isl=32)
    assert all(r.extra["response_format"]["type"] == "json_schema" for r in st)


def _metric(text: str, name: str) -> float:
    m = re.search(name + r"\{[^}]*\} ([0-9.e+]+)", text)
    return float(m.group(1)) if m else 0.0


@pytest.mark.slow
def test_bench_end_to_end_against_a_real_server(server: Any, tmp_path: Path) -> None:
    before = httpx.get(f"{server.url}/metrics").text
    out = tmp_path / "bench"
    r = subprocess.run(
        [sys.executable, "-m", "tripod.cli", "bench", "--base-url", f"{server.url},label=tripod-test",
         "--concurrency", "1,3", "--prompts-per-concurrency", "2", "--isl", "40", "--osl", "12",
         "--warmup", "0", "--slo", "ttft=60000,tpot=60000", "--out", str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert r.returncode == 0, r.stderr
    after = httpx.get(f"{server.url}/metrics").text
    data = json.loads((out / "results.json").read_text())
    runs = data["runs"]
    assert [x["concurrency"] for x in runs] == [1, 3]
    assert [x["completed"] for x in runs] == [2, 6] and all(x["failed"] == 0 for x in runs)
    for x in runs:
        assert x["output_tokens"] == 12 * x["completed"]  # ignore_eos: exactly osl each
        for m in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            assert set(x[m]) == {"mean", "p50", "p90", "p95", "p99"} and x[m]["p50"] > 0
        assert x["interactivity"] > 0 and x["goodput"] == pytest.approx(x["request_throughput"])
    # The totals are the server's own accounting (its /metrics counters moved by as much).
    out_tokens = sum(x["output_tokens"] for x in runs)
    in_tokens = sum(x["input_tokens"] for x in runs)
    assert _metric(after, "tripod:generation_tokens_total") - _metric(before, "tripod:generation_tokens_total") == out_tokens
    assert _metric(after, "tripod:prompt_tokens_total") - _metric(before, "tripod:prompt_tokens_total") == in_tokens
    assert data["config"]["options"]["dataset"] == "random" and data["config"]["machine"]["cores"]
    # The record follows the machine (tripod/bench/machine.py) and the server's compute path.
    machine = data["config"]["machine"]
    assert machine["isa_level"] in ("avx512_bf16", "avx512", "avx2", "baseline") and machine["vendor"]
    assert len(machine["isa"]) == 12 and all(isinstance(v, bool) for v in machine["isa"].values())
    (served,) = data["config"]["targets"][0]["served"]
    assert served["owned_by"] == "tripod" and served["dtype"] and "served_error" not in data["config"]["targets"][0]
    assert f"ISA {machine['isa_level']}" in (out / "report.html").read_text()
    assert f"machine: {machine['cpu']}" in r.stderr and "tripod-test: " in r.stderr
    for f in ("results.csv", "pareto.png", "latency.png", "report.html"):
        assert (out / f).stat().st_size > 0, f
    assert (out / "pareto.png").read_bytes()[:4] == b"\x89PNG"
    assert "pareto.png" in (out / "report.html").read_text()
    assert len((out / "results.csv").read_text().splitlines()) == 3
    # compare overlays earlier runs
    cmp = subprocess.run([sys.executable, "-m", "tripod.cli", "bench", "compare", str(out), str(out),
                          "--out", str(tmp_path / "cmp")], capture_output=True, text=True, timeout=120)
    assert cmp.returncode == 0, cmp.stderr
    assert len(json.loads((tmp_path / "cmp" / "results.json").read_text())["runs"]) == 4


@pytest.mark.slow
def test_launch_and_ctrl_c_keeps_what_was_measured(tmp_path: Path) -> None:
    """--launch starts tripod for the run; Ctrl-C mid-run stops cleanly (exit 130), writes the
    levels measured so far, and takes the launched server down with it."""
    import signal

    out = tmp_path / "bench"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tripod.cli", "bench", "--launch",
         "--launch-args", "--dtype float32 --kernels optimized --kv-cache-tokens 8192 --threads 2",
         "--concurrency", "1,2", "--prompts-per-concurrency", "12", "--isl", "24", "--osl", "16",
         "--warmup", "1", "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        # The first level's summary line is printed after its results are written; from then on
        # a Ctrl-C lands in the second level (or just before it) and must end the run cleanly.
        assert proc.stderr is not None
        seen = []
        while True:
            line = proc.stderr.readline()
            assert line, "".join(seen)
            seen.append(line)
            if line.startswith("tripod C=1:"):
                break
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "interrupted" in err
    runs = json.loads((out / "results.json").read_text())["runs"]
    assert runs[0]["target"] == "tripod" and runs[0]["concurrency"] == 1 and runs[0]["completed"] == 12
    # A Ctrl-C between levels ends the run there; one inside level 2 records it as far as it got.
    assert len(runs) in (1, 2) and (len(runs) == 1 or runs[1]["completed"] < 24)
    assert (out / "report.html").exists()
    launched = json.loads((out / "results.json").read_text())["config"]["targets"][0]["base_url"]
    with pytest.raises(httpx.TransportError):
        httpx.get(launched + "/health", timeout=5)


@pytest.mark.slow
def test_open_loop_agentic_and_structured_runs(server: Any, tmp_path: Path) -> None:
    """Open loop (Poisson arrivals) over agentic sessions, and json_schema traffic."""

    def bench(name: str, *args: str) -> dict[str, Any]:
        r = subprocess.run([sys.executable, "-m", "tripod.cli", "bench", "--base-url", server.url, "--warmup", "0",
                            "--out", str(tmp_path / name), *args], capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr
        return dict(json.loads((tmp_path / name / "results.json").read_text())["runs"][0])

    ag = bench("agentic", "--dataset", "agentic", "--request-rate", "5", "--burstiness", "0.5", "--num-prompts", "6",
               "--turns", "3", "--isl", "16", "--osl", "8", "--prefix-len", "48", "--think-time", "0.05")
    assert ag["mode"] == "open" and ag["request_rate"] == 5.0 and ag["concurrency"] is None
    assert ag["completed"] == 6 and ag["failed"] == 0
    assert ag["session_p90_ms_per_token"] > 0
    assert ag["cached_token_share"] > 0.2  # later turns re-send the growing history
    st = bench("structured", "--dataset", "structured", "--concurrency", "2", "--prompts-per-concurrency", "1",
               "--isl", "24", "--osl", "80")
    assert st["completed"] == 2 and st["failed"] == 0 and st["output_tokens"] > 0
