"""Serving throughput over HTTP, measured the way the peer harness (benchmarks/peers/) measures the peers.

Streams /v1/completions from a running OpenAI-compatible server, closed loop with C requests
in flight: prompts of ~256 tokens, exactly 128 output tokens (``ignore_eos``), greedy.
Reports output tok/s and TTFT p50/p99 per concurrency. (``tripod bench`` will supersede this.)

    python benchmarks/serve_throughput.py --url http://127.0.0.1:8000 --concurrency 1 8 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import httpx

WORDS = ("river stone light cloud garden window market letter engine signal harbor forest "
         "lantern winter mirror bridge candle meadow orbit thunder").split()


def prompt(i: int, tokens: int = 256) -> str:
    # Distinct from the first word on, so the prefix cache does not help (as in the peers' runs).
    return f"Request {i}: " + " ".join(WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(tokens - 6))


async def run(url: str, model: str | None, concurrency: int, requests: int, out_tokens: int) -> dict[str, float]:
    ttfts: list[float] = []
    total_tokens = 0
    counter = iter(range(requests))

    async with httpx.AsyncClient(base_url=url, timeout=600) as client:

        async def worker() -> None:
            nonlocal total_tokens
            for i in counter:
                body = {"prompt": prompt(i + concurrency * 1000), "max_tokens": out_tokens, "temperature": 0,
                        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
                if model:
                    body["model"] = model
                t0 = time.perf_counter()
                first = None
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    r.raise_for_status()
                    async for line in r.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        obj = json.loads(line[6:])
                        if first is None and obj.get("choices"):
                            first = time.perf_counter() - t0
                        if obj.get("usage"):
                            total_tokens += obj["usage"]["completion_tokens"]
                ttfts.append(first or 0.0)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    ttfts.sort()
    return {
        "concurrency": concurrency,
        "requests": requests,
        "tok_s": total_tokens / wall,
        "ttft_p50": statistics.median(ttfts),
        "ttft_p99": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
        "wall_s": wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default=None)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--rounds", type=int, default=2, help="requests per worker")
    ap.add_argument("--out-tokens", type=int, default=128)
    args = ap.parse_args()
    print("| C | requests | output tok/s | TTFT p50 | TTFT p99 |")
    print("|---|---|---|---|---|")
    for c in args.concurrency:
        asyncio.run(run(args.url, args.model, 1, 1, 8))  # warm-up
        s = asyncio.run(run(args.url, args.model, c, c * args.rounds, args.out_tokens))
        print(f"| {c} | {s['requests']} | {s['tok_s']:.1f} | {s['ttft_p50']:.2f} s | {s['ttft_p99']:.2f} s |", flush=True)


if __name__ == "__main__":
    main()
