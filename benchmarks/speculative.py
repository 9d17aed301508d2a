"""Speculative decoding over HTTP: each method against plain decoding, on copy-heavy and random traffic.

    python benchmarks/speculative.py                         # the full sweep (slow on a CPU)
    python benchmarks/speculative.py --methods none,ngram --concurrency 1 --prompts 2   # a quick look

For each method (``none`` = no ``--speculative``) one ``tripod serve`` is started on a free port,
measured with ``tripod bench`` (``--dataset copy``: rewrite / rename / reverse / repeat prompts whose
answers reuse the prompt, the model stopping by itself within ``--copy-max-tokens``; ``--dataset
random``: exactly ``--random-osl`` tokens, ``ignore_eos``) at each concurrency, and stopped before
the next. Acceptance rate and mean accepted length come from the server's
``tripod:spec_decode_num_*_total`` counters, scraped by ``tripod bench`` before and after each
level. Speedup = output tok/s / that of ``none`` at the same dataset and concurrency. The table is
rewritten after every method, so an interrupted sweep keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tripod.fleet.process import free_port, spawn_serve, wait_healthy  # noqa: E402

Row = dict[str, Any]


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", default="none,ngram,self:8,draft:embedded",
                    help="comma-separated: none | ngram | self:K | draft:PATH | draft:embedded")
    ap.add_argument("--datasets", default="copy,random", help="comma-separated tripod bench datasets")
    ap.add_argument("--concurrency", default="1,4,16", help="comma-separated levels")
    ap.add_argument("--prompts", type=int, default=4, help="prompts per concurrency (K x C requests per level)")
    ap.add_argument("--warmup", type=int, default=1, help="requests per level before measuring")
    ap.add_argument("--copy-isl", type=int, default=300, help="copy: prompt tokens (at most)")
    ap.add_argument("--copy-max-tokens", type=int, default=256, help="copy: most output tokens (stops by itself)")
    ap.add_argument("--random-isl", type=int, default=256)
    ap.add_argument("--random-osl", type=int, default=128, help="random: output tokens, exactly (ignore_eos)")
    ap.add_argument("--num-draft-tokens", type=int, default=4)
    ap.add_argument("--serve-args", default="", help="more tripod serve options, e.g. '--dtype bfloat16'")
    ap.add_argument("--start-timeout", type=float, default=600.0, help="seconds a server may take to start")
    ap.add_argument("--work-dir", default=None, help="bench outputs and server logs (default: a temporary folder)")
    ap.add_argument("--out", default=str(REPO / "benchmarks/results/speculative.md"))
    return ap.parse_args()


def _serve_args(method: str, args: argparse.Namespace) -> list[str]:
    spec = [] if method == "none" else ["--speculative", method, "--num-draft-tokens", str(args.num_draft_tokens)]
    return [*spec, *shlex.split(args.serve_args)]


def _bench(url: str, dataset: str, args: argparse.Namespace, out: Path) -> list[Row]:
    """One ``tripod bench`` run (a subprocess: its own progress bar and table) → its runs."""
    isl, osl = (args.copy_isl, args.copy_max_tokens) if dataset == "copy" else (args.random_isl, args.random_osl)
    cmd = [sys.executable, "-m", "tripod.cli", "bench", "--base-url", url, "--dataset", dataset,
           "--concurrency", args.concurrency, "--prompts-per-concurrency", str(args.prompts),
           "--warmup", str(args.warmup), "--isl", str(isl), "--osl", str(osl), "--out", str(out)]
    rc = subprocess.run(cmd, cwd=REPO).returncode
    if rc != 0 or not (out / "results.json").exists():
        raise RuntimeError(f"tripod bench exited with {rc}")
    return list(json.loads((out / "results.json").read_text())["runs"])


def _measure_method(method: str, args: argparse.Namespace, work: Path) -> tuple[list[Row], str | None]:
    """Start the server for ``method``, bench every dataset, stop it. (rows, why it failed or None)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    tag = method.replace(":", "-").replace("/", "_")
    log_path = work / f"serve-{tag}.log"
    print(f"\n== {method}: starting tripod serve {' '.join(_serve_args(method, args))} (log {log_path})",
          file=sys.stderr, flush=True)
    rows: list[Row] = []
    with open(log_path, "wb") as log:
        proc = spawn_serve("127.0.0.1", port, _serve_args(method, args), log=log)
        try:
            why = wait_healthy(url, [proc], args.start_timeout)
            if why is not None:
                return rows, f"the server {why} (see {log_path})"
            for dataset in args.datasets.split(","):
                print(f"-- {method}, dataset {dataset}", file=sys.stderr, flush=True)
                for r in _bench(url, dataset, args, work / f"bench-{tag}-{dataset}"):
                    rows.append({**r, "method": method})
        except RuntimeError as e:
            return rows, str(e)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    return rows, None


def machine() -> str:
    """The CPU's model name and core count (lscpu), for result headers."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        model = next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        model = "unknown CPU"
    return f"{model}, {os.cpu_count()} cores"


def _fmt(x: float | None, spec: str, suffix: str = "") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:{spec}}{suffix}"


def _table(rows: list[Row]) -> list[str]:
    base = {(r["dataset"], r["concurrency"]): r["output_throughput"] for r in rows if r["method"] == "none"}
    lines = ["| method | dataset | C | ok/failed | out tok/s | TPOT p50 ms | acceptance | mean accepted length | speedup |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["dataset"], r["concurrency"] or 0)):
        sd = r.get("spec_decode") or {}
        has = bool(sd.get("draft_tokens"))
        ref = base.get((r["dataset"], r["concurrency"]))
        speedup = r["output_throughput"] / ref if ref else None
        lines.append(
            f"| {r['method']} | {r['dataset']} | {r['concurrency']} | {r['completed']}/{r['failed']} "
            f"| {_fmt(r['output_throughput'], '.1f')} | {_fmt(r['tpot_ms']['p50'], '.1f')} "
            f"| {_fmt(sd.get('acceptance_rate') if has else None, '.0%')} "
            f"| {_fmt(sd.get('mean_accepted_length') if has else None, '.2f')} | {_fmt(speedup, '.2f', 'x')} |"
        )
    return lines


def _write(out: Path, rows: list[Row], failures: dict[str, str], command: str, started: str) -> None:
    lines = [
        "# Speculative decoding over HTTP",
        "",
        f"Machine: {machine()}. Model: embedded SmolLM2-135M-Instruct unless `--serve-args` says otherwise.",
        f"Command: `{command}` ({started}).",
        "",
        "Greedy. `copy`: rewrite-with-typos-fixed / rename-a-variable / reverse-a-list / repeat-and-summarize",
        "prompts (tripod/bench/copy_tasks.py), the model stopping by itself; `random`: random words, a fixed",
        "output length (ignore_eos). Acceptance = accepted / draft tokens; mean accepted length = 1 +",
        "accepted / drafts (tokens per verification round), from the server's `tripod:spec_decode_num_*_total`.",
        "Speedup = output tok/s / that of `none` at the same dataset and C.",
        "",
        *_table(rows),
    ]
    if failures:
        lines += ["", "Not measured:", *[f"- `{m}`: {why}" for m, why in failures.items()]]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")


def main() -> int:
    args = _args()
    command = "python benchmarks/speculative.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    started = time.strftime("%Y-%m-%d %H:%M")
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="tripod-spec-"))
    work.mkdir(parents=True, exist_ok=True)
    out = Path(args.out)
    rows: list[Row] = []
    failures: dict[str, str] = {}
    try:
        for method in [m.strip() for m in args.methods.split(",") if m.strip()]:
            got, why = _measure_method(method, args, work)
            rows += got
            if why is not None:
                failures[method] = why
                print(f"{method}: {why}", file=sys.stderr)
            _write(out, rows, failures, command, started)
    except KeyboardInterrupt:
        print("interrupted: keeping what was measured", file=sys.stderr)
        _write(out, rows, failures, command, started)
        return 130
    print("\n".join(_table(rows)))
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
