"""Prefill/decode disaggregation on a mixed workload: decode ITL p99 with and without it, at equal
total cores.

Workload (the same for every configuration): ``--decoders`` steady decoders, each a closed loop of
streamed chat requests (a short unique prompt, ``--decode-tokens`` output tokens, EOS ignored), and
long-prompt arrivals: every ``--arrival-interval`` s a request with a unique ``--long-tokens``-token
prompt (8 output tokens). The decoders' inter-token latency (the gaps between consecutive streamed
chunks of one answer; tripod streams one chunk per engine step) is what disaggregation is meant to
protect: a long prefill on the replica that decodes stalls its decoders' steps.

Configurations, each a fresh ``tripod serve`` fleet on the embedded model with ``--threads 1`` per
replica (so equal total cores):

- ``ordinary``: ``--replicas N`` (N = the total), the cache-aware router spreads both kinds of request;
- ``single`` (optional): ``--replicas 1 --threads N``: one replica with every core;
- ``pd``: ``--replicas N-P --prefill-replicas P``: long prompts are prefilled on the prefill
  replicas and handed to a decode replica (the decoders' short prompts are under the router's
  hand-over threshold and go straight to a decode replica).

Recorded in ``benchmarks/results/pd_disaggregation.md``.

    .venv/bin/python benchmarks/pd_disaggregation.py --replicas 2 --prefill-replicas 1 --seconds 60 \\
        --out /tmp/pd.json
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_process import ServeProcess

WORDS = ("harbour lantern copper orchard violet glacier meadow falcon ember quartz willow canyon saffron thunder "
         "marble prairie beacon cobalt juniper tundra velvet compass aurora cedar delta granite horizon ivory "
         "jasmine kestrel lagoon mosaic nectar obsidian pebble quiver raven sierra").split()


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def pct(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(p / 100 * len(s)))]


async def stream(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> tuple[float | None, list[float]]:
    """One streamed answer: its TTFT and the gaps between its chunks (seconds)."""
    t0 = time.perf_counter()
    times: list[float] = []
    async with client.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and '"content"' in line:
                times.append(time.perf_counter())
    ttft = times[0] - t0 if times else None
    return ttft, [b - a for a, b in itertools.pairwise(times)]


async def workload(url: str, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=64)
    gaps: list[float] = []
    long_ttft: list[float] = []
    decoded = [0]
    end = time.perf_counter() + args.warmup + args.seconds
    measure_from = time.perf_counter() + args.warmup
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def decoder(i: int) -> None:
            while time.perf_counter() < end:
                msgs = [{"role": "user", "content": f"Decoder {i}: {_words(rng, 12)}. Tell me a story."}]
                t = time.perf_counter()
                _, g = await stream(client, url, {"model": "default", "messages": msgs, "max_tokens": args.decode_tokens,
                                                  "temperature": 0, "ignore_eos": True})
                if t >= measure_from:
                    gaps.extend(g)
                    decoded[0] += len(g) + 1

        async def arrivals() -> None:
            tasks = []
            k = 0
            while time.perf_counter() < end - args.arrival_interval:
                await asyncio.sleep(args.arrival_interval)  # the open-loop schedule of long prompts
                k += 1
                msgs = [{"role": "system", "content": f"Document {seed}-{k}: " + _words(rng, args.long_tokens)},
                        {"role": "user", "content": "Summarise it in one line."}]

                async def one(m: list[dict[str, str]] = msgs, at: float = time.perf_counter()) -> None:
                    ttft, _ = await stream(client, url, {"model": "default", "messages": m, "max_tokens": 8,
                                                         "temperature": 0})
                    if ttft is not None and at >= measure_from:
                        long_ttft.append(ttft)

                tasks.append(asyncio.create_task(one()))
            await asyncio.gather(*tasks)

        await asyncio.gather(arrivals(), *(decoder(i) for i in range(args.decoders)))
    return {"itl_ms": {p: round(1000 * (pct(gaps, p) or 0), 1) for p in (50, 90, 99)},
            "itl_mean_ms": round(1000 * statistics.mean(gaps), 1) if gaps else None,
            "decode_tokens_per_s": round(decoded[0] / args.seconds, 1), "gaps": len(gaps),
            "long_prompts": len(long_ttft),
            "long_ttft_ms": {p: round(1000 * (pct(long_ttft, p) or 0)) for p in (50, 99)}}


def run(config: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    base = ["--threads", "1", "--kv-cache-tokens", str(args.kv_cache_tokens), "--replica-log-dir", str(tmp / config)]
    if args.dtype:
        base += ["--dtype", args.dtype]
    if config == "ordinary":
        fleet = ["--replicas", str(args.replicas)]
    elif config == "single":  # one replica with every thread (the same cores, no router split)
        fleet = ["--replicas", "1", "--threads", str(args.replicas)]
    else:
        fleet = ["--replicas", str(args.replicas - args.prefill_replicas), "--prefill-replicas",
                 str(args.prefill_replicas)]
    srv = ServeProcess(tmp, [*fleet, *base], ready_path="/health", name=config)
    try:
        deadline = time.monotonic() + 300
        while True:  # every replica routable (the fleet is ready when one is)
            f = httpx.get(srv.url + "/fleet", timeout=5).json()
            want = 1 if config == "single" else args.replicas
            if all(r["state"] == "healthy" for r in f["replicas"]) and len(f["replicas"]) == want:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{config}: replicas not healthy: {f}")
            time.sleep(0.5)  # polling for start-up
        out = asyncio.run(workload(srv.url, args, seed=1))
        out["pd"] = httpx.get(srv.url + "/fleet", timeout=5).json()["pd"]
        return out
    finally:
        srv.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=2, help="replicas in all (each --threads 1)")
    p.add_argument("--prefill-replicas", type=int, default=1)
    p.add_argument("--decoders", type=int, default=4)
    p.add_argument("--decode-tokens", type=int, default=48)
    p.add_argument("--long-tokens", type=int, default=600, help="words of each long prompt (~1.3 tokens each)")
    p.add_argument("--arrival-interval", type=float, default=10.0)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--warmup", type=float, default=5.0)
    p.add_argument("--kv-cache-tokens", type=int, default=16384)
    p.add_argument("--dtype", default=None)
    p.add_argument("--configs", default="ordinary,pd")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    results: dict[str, Any] = {"args": vars(args), "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                               "load_average_before": os.getloadavg()}
    with tempfile.TemporaryDirectory() as d:
        for config in args.configs.split(","):
            results[config] = run(config, args, Path(d))
            results[config]["load_average_after"] = os.getloadavg()
            print(config, json.dumps(results[config]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
