"""One cold prefill through the offline Engine on the embedded model, under torch's profiler:
where a prompt's time to first token goes (the kernels' attention, the linears, the rest).

    PYTHONPATH=$PWD python benchmarks/prefill_profile.py [--tokens 1500] [--json OUT]

The engine runs its defaults (stored Q4_1 blocks, bf16 activations, the best kernel level, chunks
of 256) with one generated token, so the measured time is the prefill. Each run: a warm-up
prompt first (kernels loaded, caches allocated), then a different prompt of ``--tokens`` tokens
from an empty prefix cache. Reports the wall time of the prefill and the profiler's self CPU
time per op (the top ops, tripod's kernels by name).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import time
from datetime import UTC, datetime
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from tripod import Engine, SamplingParams


def _prompt(engine: Engine, tokens: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    # Ordinary vocabulary ids (no special tokens): the prompt's content does not change the work.
    return torch.randint(100, min(engine.model_config.vocab_size, 40000), (tokens,), generator=g).tolist()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=1500)
    ap.add_argument("--threads", type=int, default=None, help="engine CPU threads (default: torch's)")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--json", default=None, help="append the results to this JSON file")
    ap.add_argument("--label", default="", help="a name for this run in the JSON (e.g. before/after)")
    ap.add_argument("--no-profile", action="store_true", help="time the prefill without torch's profiler")
    args = ap.parse_args()
    overrides = {"num_threads": args.threads} if args.threads else {}
    engine = Engine(kv_cache_tokens=max(8192, 2 * args.tokens + 64), **overrides)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    engine.generate([_prompt(engine, 300, 1)], params)  # warm-up
    engine.reset_prefix_cache()
    prompt = _prompt(engine, args.tokens, 2)
    with contextlib.nullcontext() if args.no_profile else profile(activities=[ProfilerActivity.CPU]) as prof:
        t0, c0 = time.perf_counter(), time.process_time()
        engine.generate([prompt], params)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    events = [] if prof is None else sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total_self = sum(e.self_cpu_time_total for e in events) / 1e6
    rows = [{"op": e.key, "self_s": e.self_cpu_time_total / 1e6, "calls": e.count} for e in events[: args.top]]
    print(f"{args.tokens}-token cold prefill: {wall:.3f} s wall, {cpu:.3f} s CPU time on {torch.get_num_threads()} thread(s)")
    for r in rows:
        print(f"  {r['self_s']:8.3f} s  {r['calls']:6d} calls  {r['op']}")
    print(f"  {total_self:8.3f} s  self CPU time of all ops")
    if args.json:
        path = Path(args.json)
        data = json.loads(path.read_text()) if path.exists() else []
        data.append({"label": args.label, "date": datetime.now(UTC).isoformat(timespec="seconds"),
                     "cpu": platform.processor(), "tokens": args.tokens, "threads": torch.get_num_threads(),
                     "wall_s": wall, "cpu_s": cpu, "ops": rows})
        path.write_text(json.dumps(data, indent=1) + "\n")


if __name__ == "__main__":
    main()
