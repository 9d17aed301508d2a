"""Where a second of ``tripod serve`` goes under load: the served-workload profile.

Starts ``tripod serve`` (with the given options), and for each concurrency C runs
``tripod bench`` (random ISL/OSL, closed loop, streamed) against it while reading, before and
after the level:
- the engine loop's own timers (``/debug/engine`` → ``time``): scheduling, building the batch,
  the forward pass of decode-only steps and of steps carrying prefill tokens, sampling (grammar
  masks included), bookkeeping, ZMQ/msgpack (decode messages, encode + send outputs), idle;
- the CPU seconds of each process from ``/proc``: the engine process, the HTTP process (which
  tokenizes, detokenizes, formats SSE and shares the cores), and the bench client itself.

Shares are of the level's measured duration (the bench's own window: the client's start-up and
report, when the engine idles, are taken out of "idle"); CPU rates are over the whole level. "loop other" is the engine loop's wall time not covered by
a timer (Python between the timed parts, the parent check, heartbeats).

    .venv/bin/python benchmarks/serve_profile.py --concurrency 1,8,32 --out benchmarks/results/serve_profile-before.md
    .venv/bin/python benchmarks/serve_profile.py --serve-args "--weights stored" --concurrency 1
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from offline_throughput import machine_info

from tripod.fleet.process import free_port, spawn_serve, wait_healthy

TICK = os.sysconf("SC_CLK_TCK")
PHASES = ["schedule", "prepare", "decode_forward", "prefill_forward", "sample", "bookkeeping", "ipc", "idle"]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        txt = (task / "children").read_text().split()
        out.extend(int(x) for x in txt)
    return out


def set_fifo(pid: int, prio: int, io_prio: int | None = None) -> None:
    """SCHED_FIFO for every thread of ``pid`` (``--rt``); ZMQ's I/O threads at ``io_prio``
    (the engine's compute threads spin: its sender thread must be able to preempt them)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        comm = (task / "comm").read_text().strip()
        p = io_prio if io_prio is not None and comm.startswith("ZMQbg") else prio
        os.sched_setscheduler(int(task.name), os.SCHED_FIFO, os.sched_param(p))


def engine_stats(url: str) -> dict[str, object]:
    return httpx.get(f"{url}/debug/engine", timeout=30).json()  # type: ignore[no-any-return]


def _bench_cmd(url: str, c: int, k: int, args: argparse.Namespace, out: str) -> list[str]:
    return [
        sys.executable, "-m", "tripod.cli", "bench", "--base-url", url, "--dataset", "random",
        "--isl", str(args.isl), "--osl", str(args.osl), "--concurrency", str(c),
        "--prompts-per-concurrency", str(k), "--warmup", "0", "--out", out,
    ]


def run_level(url: str, server_pid: int, engine_pid: int, c: int, args: argparse.Namespace) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as out:
        if args.warmup:
            # A separate client first, so that the engine's counters below cover the measured
            # requests only.
            subprocess.run(_bench_cmd(url, min(c, args.warmup), 1, args, out), check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        cmd = _bench_cmd(url, c, args.k, args, out)
        s0 = engine_stats(url)
        cpu0 = {"engine": cpu_seconds(engine_pid), "http": cpu_seconds(server_pid)}
        t0 = time.perf_counter()
        bench = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if args.rt:
            set_fifo(bench.pid, 20)
        # NOTE: read the client's CPU while it still exists (a reaped child has no /proc entry).
        bench_cpu = 0.0
        while bench.poll() is None:
            try:
                bench_cpu = cpu_seconds(bench.pid)
            except (FileNotFoundError, ProcessLookupError):
                pass
            time.sleep(0.5)  # sampling the client's CPU counter, not waiting for an event
        wall = time.perf_counter() - t0
        if bench.returncode != 0:
            raise RuntimeError(f"tripod bench failed at C={c} (exit {bench.returncode})")
        s1 = engine_stats(url)
        cpu1 = {"engine": cpu_seconds(engine_pid), "http": cpu_seconds(server_pid)}
        res = json.loads((Path(out) / "results.json").read_text())
    level = res["runs"][0]
    t0d, t1d = s0["time"], s1["time"]  # type: ignore[index]
    phases = {p: t1d[p] - t0d[p] for p in PHASES}  # type: ignore[index]
    # The window is the bench's own measured duration: the client's start-up (imports, tokenizer)
    # before it and its report after it leave the engine idle and are not part of the load.
    measured = float(level["duration_s"])
    phases["idle"] = max(0.0, phases["idle"] - (wall - measured))
    return {
        "c": c,
        "wall": measured,
        "tok_s": level["output_throughput"],
        "ttft_p50": level["ttft_ms"]["p50"],
        "tpot_p50": level["tpot_ms"]["p50"],
        "itl_p50": level["itl_ms"]["p50"],
        "phases": phases,
        "steps": s1["steps"] - s0["steps"],  # type: ignore[operator]
        "prefill_tokens": s1["prefill_tokens"] - s0["prefill_tokens"],  # type: ignore[operator]
        "generated": s1["generated_tokens"] - s0["generated_tokens"],  # type: ignore[operator]
        "cpu": {
            "engine": cpu1["engine"] - cpu0["engine"],
            "http": cpu1["http"] - cpu0["http"],
            "bench client": bench_cpu,
        },
    }


def table(rows: list[dict[str, object]]) -> list[str]:
    cs = [r["c"] for r in rows]
    lines = ["| share of wall time | " + " | ".join(f"C={c}" for c in cs) + " |", "|---|" + "---|" * len(cs)]

    def pct(x: float, r: dict[str, object]) -> str:
        return f"{100 * x / r['wall']:.1f} %"  # type: ignore[operator]

    names = {
        "schedule": "engine: scheduling (Python)",
        "prepare": "engine: building batch tensors (Python)",
        "decode_forward": "engine: forward, decode-only steps",
        "prefill_forward": "engine: forward, steps with prefill tokens",
        "sample": "engine: sampling (+ grammar masks)",
        "bookkeeping": "engine: bookkeeping after sampling (Python)",
        "ipc": "engine: ZMQ/msgpack in and out",
        "idle": "engine: idle (waiting for requests)",
    }
    for p in PHASES:
        lines.append(f"| {names[p]} | " + " | ".join(pct(r["phases"][p], r) for r in rows) + " |")  # type: ignore[index]
    lines.append("| engine: loop other (untimed Python) | " + " | ".join(
        pct(max(0.0, r["wall"] - sum(r["phases"].values())), r) for r in rows) + " |")  # type: ignore[union-attr, operator]
    for who in ("engine", "http", "bench client"):
        lines.append(f"| CPU-seconds per second: {who} process | " + " | ".join(
            f"{r['cpu'][who] / r['wall']:.2f}" for r in rows) + " |")  # type: ignore[index, operator]
    lines.append("| output tok/s (bench) | " + " | ".join(f"{r['tok_s']:.1f}" for r in rows) + " |")
    lines.append("| TTFT p50 / TPOT p50 (ms) | " + " | ".join(f"{r['ttft_p50']:.0f} / {r['tpot_p50']:.1f}" for r in rows) + " |")
    lines.append("| engine steps per second | " + " | ".join(f"{r['steps'] / r['wall']:.1f}" for r in rows) + " |")  # type: ignore[operator]
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--isl", type=int, default=256)
    ap.add_argument("--osl", type=int, default=128)
    ap.add_argument("--k", type=int, default=2, help="requests per concurrent user")
    ap.add_argument("--warmup", type=int, default=2, help="requests before each level (not counted)")
    ap.add_argument("--serve-args", default="", help="extra tripod serve options")
    ap.add_argument("--out", default="", help="write the Markdown table here")
    ap.add_argument(
        "--rt", action="store_true",
        help="real-time priorities (root): HTTP process and client FIFO 20, engine FIFO 10, so "
        "that other work on a shared machine does not disturb the measurement",
    )
    args = ap.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(os.devnull, "wb")
    proc = spawn_serve("127.0.0.1", port, shlex.split(args.serve_args), log=log)
    try:
        why = wait_healthy(url, [proc], 600)
        if why:
            raise RuntimeError(f"tripod serve {why}")
        kids = children(proc.pid)
        assert len(kids) == 1, f"expected one engine process, found {kids}"
        engine_pid = kids[0]
        if args.rt:
            # The HTTP process and the client above the engine, the engine above everything else.
            set_fifo(proc.pid, 20)
            set_fifo(engine_pid, 10, io_prio=20)
        rows = []
        for c in (int(x) for x in args.concurrency.split(",")):
            rows.append(run_level(url, proc.pid, engine_pid, c, args))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        proc.terminate()
        proc.wait(60)
    info = machine_info()
    lines = [
        f"Machine: {info['cpu']}, {info['cores']} cores, torch {info['torch']}, {info['date']}.",
        f"`tripod serve {args.serve_args}`; `tripod bench` random {args.isl} → {args.osl}, closed loop, "
        f"{args.k} requests per concurrent user, streamed, client on the same machine.",
        f"Command: `python benchmarks/serve_profile.py {' '.join(sys.argv[1:])}`",
        "",
        *table(rows),
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
