"""Decode speed of the embedded model on each ISA level of tripod's kernels this CPU supports, in
bfloat16, float32 and with the GGUF's Q4_1 weights executed as stored: what an AVX2-only CPU gets
(the avx2 level, forced with ``--kernels avx2``) next to the AVX-512 levels on the same machine.
Every level computes the same bits (tests/kernels/test_kernel_levels.py); only the speed differs.

Closed batch, offline engine: C requests at once, ~230-token prompts, exactly 128 new tokens
(ignore_eos), greedy. Output tok/s = C * 128 / wall time. Writes ``benchmarks/results/isa_levels.md``.

    .venv/bin/python benchmarks/isa_levels.py                      # every supported level (~3 min)
    .venv/bin/python benchmarks/isa_levels.py --levels avx2 --concurrency 1,16
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

from tripod import Engine, SamplingParams, kernels
from tripod.bench.machine import describe as describe_machine

ROOT = Path(__file__).resolve().parent
PROMPT_LEN = 230
NEW_TOKENS = 128


def run(level: str, dtype: str, weights: str, concurrency: list[int]) -> list[float]:
    eng = Engine(dtype=dtype, kernels=level, weights=weights, kv_cache_tokens=16384, max_running=64)
    assert eng.runner.card() == {"backend": "cpu", "isa": level}, eng.runner.card()
    rng = random.Random(0)
    vocab = eng.model_config.vocab_size
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    eng.generate([[rng.randrange(100, vocab) for _ in range(32)]], SamplingParams(max_tokens=8, ignore_eos=True))  # warm
    out = []
    for c in concurrency:
        prompts = [[rng.randrange(100, vocab) for _ in range(PROMPT_LEN)] for _ in range(c)]
        t0 = time.perf_counter()
        eng.generate(prompts, params)
        out.append(c * NEW_TOKENS / (time.perf_counter() - t0))
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--levels", default=",".join(kernels.supported_levels()))
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--out", default=str(ROOT / "results" / "isa_levels.md"))
    args = ap.parse_args()
    levels = [lv for lv in args.levels.split(",") if lv]
    conc = [int(c) for c in args.concurrency.split(",")]
    m = describe_machine()
    rows = []
    for lv in levels:
        for dtype, weights in (("bfloat16", "dequantized"), ("float32", "dequantized"), ("float32", "stored")):
            tps = run(lv, dtype, weights, conc)
            label = f"{dtype}" if weights == "dequantized" else "Q4_1 as stored (float32 compute)"
            rows.append((lv, label, tps))
            print(lv, label, " ".join(f"{t:.1f}" for t in tps), file=sys.stderr)
    lines = [
        "# Decode speed per ISA level of tripod's kernels (embedded SmolLM2-135M)",
        "",
        f"Measured {time.strftime('%Y-%m-%d')} on {m['cpu']} ({m['vendor']} family {m['family']} model {m['model']}), "
        f"{m['cores']} cores, ISA level {m['isa_level']} (flags: "
        f"{', '.join(k for k, v in m['isa'].items() if v)}).",
        "",
        f"Command: `.venv/bin/python benchmarks/isa_levels.py --levels {','.join(levels)} --concurrency {args.concurrency}`. "
        f"Offline engine, closed batch of C requests, {PROMPT_LEN}-token prompts, {NEW_TOKENS} new tokens, greedy; "
        "output tok/s including prefill. Lower levels are forced with `--kernels LEVEL` on this same CPU: the avx2 "
        "rows are what an AVX2-only CPU runs, at this machine's memory bandwidth (not a Zen 3's).",
        "",
        "| level | weights / dtype | " + " | ".join(f"C = {c} tok/s" for c in conc) + " |",
        "|---|---|" + "---|" * len(conc),
    ]
    lines += [f"| {lv} | {label} | " + " | ".join(f"{t:.1f}" for t in tps) + " |" for lv, label, tps in rows]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
