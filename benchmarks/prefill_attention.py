"""Prefill (extend) attention of tripod's CPU kernels, the op alone: a prompt of T tokens
prefilled in chunks of C (each chunk attends its cached prefix and itself, causally), on the
embedded model's attention shape (9 query heads, 3 KV heads, head_dim 64) or others given by
``--shapes`` (e.g. ``9x3x64,32x8x128``: a Llama-8B-like 32 query heads over 8 KV heads of 128),
bf16 or float32.

    PYTHONPATH=$PWD python benchmarks/prefill_attention.py [--library PATH.so] [--json OUT]

``--library`` loads a built kernel library by path (to time a build of another source tree,
e.g. the commit before a change, in its own process); without it the best level is built/loaded.
Prints one line per prompt length: seconds per layer for the whole prompt and GFLOP/s, counting
4·head_dim flops per (query head, key) pair (QKᵀ and PV, a multiply and an add each).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import Any

import torch


def _ops(library: str | None) -> Any:
    if library is None:
        from tripod import kernels

        assert kernels.load(wait=True), kernels.unavailable_reason()
        return kernels.ops()
    torch.ops.load_library(library)
    ns = Path(library).stem  # tripod_<level>
    return getattr(torch.ops, ns)


def _time_prompt(ops: Any, tokens: int, chunk: int, heads: int, kvh: int, d: int, dtype: torch.dtype,
                 repeats: int, clock: Any) -> float:
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(tokens + 64, 2, kvh, d, generator=g).to(dtype)
    table = torch.randperm(kv.shape[0], generator=g)[:tokens].view(1, tokens).to(torch.int32)
    q = torch.randn(tokens, heads, d, generator=g).to(dtype)
    calls = []
    for start in range(0, tokens, chunk):
        n = min(chunk, tokens - start)
        rows = torch.zeros(n, dtype=torch.int32)
        lens = torch.arange(start + 1, start + n + 1, dtype=torch.int32)
        calls.append((q[start : start + n], rows, lens))
    scale = d**-0.5
    for qc, rows, lens in calls:  # warm-up
        ops.paged_attention(qc, kv, table, rows, lens, scale)
    best = float("inf")
    for _ in range(repeats):
        t0 = clock()
        for qc, rows, lens in calls:
            ops.paged_attention(qc, kv, table, rows, lens, scale)
        best = min(best, clock() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--library", default=None, help="a built tripod_<level>.so to time (default: the best level)")
    ap.add_argument("--tokens", default="256,512,1000,1500,2000,3000")
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--shapes", default="9x3x64", help="HEADSxKV_HEADSxHEAD_DIM[,...] (default: the embedded model's)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--wall", action="store_true", help="time wall-clock (default: CPU time of this process)")
    ap.add_argument("--json", default=None, help="append the results to this JSON file")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ops = _ops(args.library)
    # On a shared machine wall time measures the neighbours too: with one thread, the process's
    # CPU time is the op's cost (--wall for wall-clock time).
    clock = time.perf_counter if args.wall else time.process_time
    dtype = getattr(torch, args.dtype)
    rows = []
    for shape in args.shapes.split(","):
        heads, kvh, d = (int(x) for x in shape.split("x"))
        for tokens in [int(x) for x in args.tokens.split(",")]:
            s = _time_prompt(ops, tokens, args.chunk, heads, kvh, d, dtype, args.repeats, clock)
            pairs = tokens * (tokens + 1) // 2 * heads
            gflops = 4 * d * pairs / s / 1e9
            rows.append({"shape": shape, "tokens": tokens, "seconds_per_layer": s, "gflops": gflops})
            print(f"{shape:>10s} {tokens:6d} tokens  {s * 1e3:9.2f} ms/layer  {gflops:7.1f} GFLOP/s", flush=True)
    if args.json:
        path = Path(args.json)
        data = json.loads(path.read_text()) if path.exists() else []
        data.append({"library": args.library or "best level", "dtype": args.dtype, "chunk": args.chunk,
                     "clock": "wall" if args.wall else "process CPU time",
                     "threads": torch.get_num_threads(), "cpu": platform.processor(), "results": rows})
        path.write_text(json.dumps(data, indent=1) + "\n")


if __name__ == "__main__":
    main()
