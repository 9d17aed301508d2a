"""Routing policies compared on a multi-turn (agentic) workload over N replicas.

For each policy: start N fresh ``tripod serve`` replicas (empty caches), a ``tripod route --policy P``
in front of them, and run ``tripod bench --dataset agentic`` against the router (sessions whose
turns resend the growing conversation). Records the cached share of prompt tokens (from the
replicas' own ``usage``) and TTFT, and the cache_aware / round_robin ratios, as markdown.

    python benchmarks/fleet_routing.py --replicas 2 --concurrency 8 --out benchmarks/results/fleet_routing.md

``--dataset shared-prefix --num-groups 1`` sends every request with one hot system prompt: the
"routed per replica" column then shows whether cache_aware's balance guard spreads it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from tripod.fleet.process import free_port, spawn_serve, wait_healthy


def _wait(url: str, procs: list[subprocess.Popen[bytes]]) -> None:
    why = wait_healthy(url, procs, 300)
    if why is not None:
        raise SystemExit(f"{url}: {why}")


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            p.kill()


def run_policy(policy: str, args: argparse.Namespace, out: Path) -> dict[str, float]:
    threads = max(1, (os.cpu_count() or 1) // args.replicas)
    serve_args = ["--dtype", args.dtype, "--kv-cache-tokens", str(args.kv_cache_tokens), "--threads", str(threads)]
    ports = [free_port() for _ in range(args.replicas)]
    replicas = [spawn_serve("127.0.0.1", p, serve_args, subprocess.DEVNULL) for p in ports]
    procs = list(replicas)
    try:
        for p in ports:
            _wait(f"http://127.0.0.1:{p}", replicas)
        rport = free_port()
        router = subprocess.Popen([sys.executable, "-m", "tripod.cli", "route", "--port", str(rport), "--policy", policy,
                                   *[a for p in ports for a in ("--replica", f"http://127.0.0.1:{p}")]],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        procs.append(router)
        url = f"http://127.0.0.1:{rport}"
        _wait(url, [router])
        cmd = [sys.executable, "-m", "tripod.cli", "bench", "--base-url", f"{url},label={policy}", "--dataset", args.dataset,
               "--num-groups", str(args.num_groups),
               "--turns", str(args.turns), "--think-time", str(args.think_time), "--prefix-len", str(args.prefix_len),
               "--isl", str(args.isl), "--osl", str(args.osl),
               "--concurrency", str(args.concurrency), "--prompts-per-concurrency", str(args.k),
               "--warmup", "0", "--seed", str(args.seed), "--out", str(out / policy)]
        subprocess.run(cmd, check=True)
        routed = [r["routed"] for r in httpx.get(url + "/fleet", timeout=10).json()["replicas"]]
    finally:
        _stop(procs)
    run = json.loads((out / policy / "results.json").read_text())["runs"][0]
    return {"cached_share": run["cached_token_share"], "ttft_mean": run["ttft_ms"]["mean"],
            "ttft_p50": run["ttft_ms"]["p50"], "ttft_p99": run["ttft_ms"]["p99"],
            "output_throughput": run["output_throughput"], "completed": run["completed"], "failed": run["failed"],
            "routed": "/".join(str(n) for n in routed)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--policies", default="round_robin,least_load,cache_aware")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--k", type=int, default=4, help="requests per level = k x concurrency")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--dataset", default="agentic", choices=["agentic", "shared-prefix"])
    p.add_argument("--num-groups", type=int, default=4, help="shared-prefix: distinct system prompts (1 = one hot prefix)")
    p.add_argument("--think-time", type=float, default=0.0, help="mean seconds between a session's turns")
    p.add_argument("--prefix-len", type=int, default=1024, help="agentic: a session's system prompt is half this")
    p.add_argument("--isl", type=int, default=256)
    p.add_argument("--osl", type=int, default=32)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-cache-tokens", type=int, default=32768)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="markdown file to write (default: print)")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="fleet-routing-"))
    rows = {pol: run_policy(pol, args, work) for pol in args.policies.split(",")}
    lines = [
        f"# Routing policies: {args.dataset}" + (f", {args.num_groups} prefix group(s)" if args.dataset == "shared-prefix" else ""),
        "",
        f"`python benchmarks/fleet_routing.py --replicas {args.replicas} --concurrency {args.concurrency} --k {args.k} "
        f"--dataset {args.dataset} --num-groups {args.num_groups} --turns {args.turns} --think-time {args.think_time} --prefix-len {args.prefix_len} --isl {args.isl} "
        f"--osl {args.osl}` on {platform.machine()} with {os.cpu_count()} CPUs, "
        f"{time.strftime('%Y-%m-%d')}; each policy on fresh replicas (empty caches); `tripod bench --dataset {args.dataset}` "
        "through `tripod route`. Cached share = cached prompt tokens / prompt tokens, from the replicas' `usage`.",
        "",
        "| policy | cached share | TTFT mean (ms) | TTFT p50 | TTFT p99 | output tok/s | completed | failed | routed per replica |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for pol, r in rows.items():
        lines.append(f"| {pol} | {r['cached_share']:.3f} | {r['ttft_mean']:.0f} | {r['ttft_p50']:.0f} | "
                     f"{r['ttft_p99']:.0f} | {r['output_throughput']:.1f} | {r['completed']:.0f} | {r['failed']:.0f} | "
                     f"{r['routed']} |")
    if "cache_aware" in rows and "round_robin" in rows:
        ca, rr = rows["cache_aware"], rows["round_robin"]
        lines += ["", f"cache_aware / round_robin: cached share x{ca['cached_share'] / max(rr['cached_share'], 1e-9):.2f}, "
                  f"mean TTFT x{ca['ttft_mean'] / rr['ttft_mean']:.2f}."]
    text = "\n".join(lines) + "\n"
    print(text)
    print(f"bench folders: {work}")
    if args.out:
        with open(args.out, "a") as f:  # runs accumulate: one table per configuration
            f.write(text + "\n")


if __name__ == "__main__":
    main()
