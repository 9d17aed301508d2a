"""SLO autoscaling on a replayed bursty trace: a fleet that scales on its measured p95 TTFT (to zero
and back) against a fixed fleet sized for the peak, on the same trace.

The trace (written as ``tripod bench --dataset trace`` reads it: JSONL, ``offset`` /
``messages`` / ``output_tokens``) is quiet, then a burst, then quiet, then silent long enough for
the autoscaled fleet to go to zero, then one last request (held while a replica cold-starts). It
is replayed open loop (each request at its offset, whatever the answers do) against:

1. ``tripod serve --min-replicas 0 --max-replicas N --slo-ttft-p95 MS`` (SLO autoscaling);
2. ``tripod serve --replicas N`` (fixed, sized for the peak).

Measured: TTFT per request (first streamed text), p95 TTFT outside the cold-start windows (from a
cold replica's launch to its first healthy probe, as ``/fleet`` reports them) against the SLO,
replica-seconds (``/fleet``'s active replicas, sampled every 0.25 s, integrated), the cold starts
(time to healthy, the held requests' TTFT) and the autoscaler's decisions with their reasons.
Recorded in ``benchmarks/results/slo_autoscale.md``.

    .venv/bin/python benchmarks/slo_autoscale_replay.py --slo-ttft-p95 2000 --out /tmp/slo.json
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_process import ServeProcess

PROMPT = "In three sentences, explain why the sky looks blue during the day and red at sunset."


def make_trace(path: Path, phases: list[tuple[float, float]], tail_gap: float, output_tokens: int) -> list[float]:
    """Offsets of a trace of ``phases`` (seconds, requests/s; evenly spaced), then one request after
    ``tail_gap`` seconds of silence; written to ``path`` as JSONL."""
    offsets: list[float] = []
    t = 0.0
    for seconds, rate in phases:
        n = int(seconds * rate)
        offsets += [t + i / rate for i in range(n)]
        t += seconds
    offsets.append(t + tail_gap)
    with path.open("w") as f:
        for i, off in enumerate(offsets):
            f.write(json.dumps({"offset": round(off, 3), "session": f"s{i}", "output_tokens": output_tokens,
                                "messages": [{"role": "user", "content": f"({i}) {PROMPT}"}]}) + "\n")
    return offsets


def load_trace(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class Fleet(ServeProcess):
    def __init__(self, tmp: Path, args: list[str]) -> None:
        super().__init__(tmp, args, ready_path="/fleet", name="fleet", stop_timeout=90.0)

    def fleet(self) -> dict[str, Any]:
        return dict(httpx.get(self.url + "/fleet", timeout=10).json())

    def wait_healthy(self, n: int, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while sum(r["state"] == "healthy" for r in self.fleet()["replicas"]) < n:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{n} replicas not healthy in time; see {self.log.name}")
            time.sleep(0.5)


async def send(client: httpx.AsyncClient, url: str, item: dict[str, Any], t0: float) -> dict[str, Any]:
    delay = t0 + item["offset"] - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)
    body = {"messages": item["messages"], "max_tokens": item["output_tokens"], "ignore_eos": True, "stream": True,
            "temperature": 0.0}
    start, wall = time.monotonic(), time.time()
    out: dict[str, Any] = {"offset": item["offset"], "wall": wall, "status": 0, "ttft_s": None, "error": None}
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            out["status"] = r.status_code
            async for line in r.aiter_lines():
                if line.startswith("data: ") and '"content"' in line and out["ttft_s"] is None:
                    obj = json.loads(line[6:])
                    if any((c.get("delta") or {}).get("content") for c in obj.get("choices") or []):
                        out["ttft_s"] = time.monotonic() - start
            if r.status_code != 200:
                out["error"] = f"status {r.status_code}"
    except httpx.HTTPError as e:
        out["error"] = f"{type(e).__name__}: {e}"
    return out


async def replay(fleet: Fleet, trace: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[tuple[float, int]]]:
    samples: list[tuple[float, int]] = []
    done = asyncio.Event()

    async def sample(client: httpx.AsyncClient) -> None:
        while not done.is_set():
            try:
                r = await client.get(fleet.url + "/fleet", timeout=5)
                samples.append((time.time(), int(r.json()["active_replicas"])))
            except (httpx.HTTPError, KeyError, ValueError):
                pass
            await asyncio.sleep(0.25)

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        sampler = asyncio.create_task(sample(client))
        t0 = time.monotonic()
        results = await asyncio.gather(*(send(client, fleet.url, item, t0) for item in trace))
        done.set()
        await sampler
    return list(results), samples


def p95(values: list[float]) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[max(0, min(len(s) - 1, round(0.95 * len(s)) - 1))]


def summarize(results: list[dict[str, Any]], samples: list[tuple[float, int]], info: dict[str, Any],
              slo_ms: float) -> dict[str, Any]:
    windows = [(c["wall"] - c["time_to_healthy_s"], c["wall"]) for c in info.get("cold_starts", [])]
    outside = [r["ttft_s"] for r in results if r["ttft_s"] is not None
               and not any(a <= r["wall"] <= b for a, b in windows)]
    inside = [r["ttft_s"] for r in results if r["ttft_s"] is not None and any(a <= r["wall"] <= b for a, b in windows)]
    replica_s = sum((b[0] - a[0]) * a[1] for a, b in itertools.pairwise(samples))
    span = samples[-1][0] - samples[0][0] if len(samples) > 1 else 0.0
    q = p95(outside)
    return {
        "requests": len(results), "errors": sum(1 for r in results if r["error"]),
        "ttft_p95_ms_outside_cold_starts": None if q is None else round(q * 1000),
        "within_slo": None if q is None else q * 1000 <= slo_ms,
        "requests_in_cold_start_windows": len(inside),
        "ttft_max_ms_in_cold_start_windows": round(max(inside) * 1000) if inside else None,
        "replica_seconds": round(replica_s, 1), "measured_seconds": round(span, 1),
        "max_active_replicas": max((n for _, n in samples), default=0),
        "cold_starts": info.get("cold_starts", []), "held_requests": info.get("held_requests", []),
        "scale_events": info.get("scale_events", []),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--slo-ttft-p95", type=float, default=2000.0, help="ms")
    ap.add_argument("--max-replicas", type=int, default=2)
    ap.add_argument("--quiet-rate", type=float, default=0.25, help="requests/s outside the burst")
    ap.add_argument("--burst-rate", type=float, default=2.0, help="requests/s in the burst")
    ap.add_argument("--phase", type=float, default=30.0, help="seconds of each phase (quiet, burst, quiet)")
    ap.add_argument("--tail-gap", type=float, default=45.0, help="silence before the last request")
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--lookback", type=float, default=10.0)
    ap.add_argument("--upscale-delay", type=float, default=0.0)
    ap.add_argument("--downscale-delay", type=float, default=15.0)
    ap.add_argument("--replica-args", default="--threads 1 --max-running 4 --kv-cache-tokens 8192")
    ap.add_argument("--only", choices=("slo", "fixed"), default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rep = args.replica_args.split()
    results: dict[str, Any] = {"args": vars(args)}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        path = tmp / "trace.jsonl"
        make_trace(path, [(args.phase, args.quiet_rate), (args.phase, args.burst_rate), (args.phase, args.quiet_rate)],
                   args.tail_gap, args.output_tokens)
        trace = load_trace(path)
        results["trace"] = {"requests": len(trace), "seconds": trace[-1]["offset"]}
        runs = {
            "slo": ["--min-replicas", "0", "--max-replicas", str(args.max_replicas), "--slo-ttft-p95",
                    str(args.slo_ttft_p95), "--lookback", str(args.lookback), "--upscale-delay", str(args.upscale_delay),
                    "--downscale-delay", str(args.downscale_delay), *rep],
            "fixed": ["--replicas", str(args.max_replicas), *rep],
        }
        for name, flags in runs.items():
            if args.only and name != args.only:
                continue
            fleet = Fleet(tmp, flags)
            try:
                if name == "fixed":
                    fleet.wait_healthy(args.max_replicas)
                t0 = time.monotonic()
                res, samples = asyncio.run(replay(fleet, trace))
                info = fleet.fleet()
                results[name] = summarize(res, samples, info, args.slo_ttft_p95)
                results[name]["wall_seconds"] = round(time.monotonic() - t0, 1)
                results[name]["autoscaler"] = info.get("autoscaler")
            finally:
                fleet.stop()
    text = json.dumps(results, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
