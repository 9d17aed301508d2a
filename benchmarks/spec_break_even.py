"""Where speculation stops paying: offline output tok/s by batch size, with and without a
proposer, on copy-heavy prompts (where drafts are accepted) and random-word prompts.

    benchmarks/spec_break_even.py [--method ngram] [--batches 1,2,4,8,16,32] [--dtype bfloat16]

Each batch of B identical-length requests runs to completion (``generate``), greedy, 128 output
tokens each (copy prompts stop by themselves); ``spec_max_batch`` is lifted. "always" drafts
the maximum every step (``spec_adaptive=False``): the break-even batch is where its ratio falls
below 1. "adaptive" is the default policy (engine/speculative/adaptive.py), which should follow
the better of the two. Prints a markdown table. Nothing is asserted: the result goes to
benchmarks/results/ with the machine.
"""

from __future__ import annotations

import argparse
import random
import time

from speculative import machine  # benchmarks/speculative.py (this script's folder is on sys.path)

from tripod import Engine, SamplingParams
from tripod.bench.copy_tasks import copy_prompts
from tripod.bench.datasets import TextMaker


def run(engine: Engine, prompts: list[list[int]], sp: SamplingParams) -> tuple[float, int]:
    t0 = time.perf_counter()
    outs = engine.generate(prompts, sp)
    return time.perf_counter() - t0, sum(len(o.token_ids) for o in outs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--method", default="ngram")
    ap.add_argument("--batches", default="1,2,4,8,16,32")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    plain = Engine(dtype=args.dtype, kernels="optimized", kv_cache_tokens=65536)
    always = Engine(dtype=args.dtype, kernels="optimized", kv_cache_tokens=65536, loaded=plain.loaded,
                    speculative=args.method, spec_max_batch=10_000, spec_adaptive=False)
    adaptive = Engine(dtype=args.dtype, kernels="optimized", kv_cache_tokens=65536, loaded=plain.loaded,
                      speculative=args.method, spec_max_batch=10_000)
    rng = random.Random(0)
    batches = [int(b) for b in args.batches.split(",")]
    n = max(batches)
    tok = plain.tokenizer
    words = TextMaker(tok, rng)
    sets = {
        "copy": [plain.apply_chat_template([{"role": "user", "content": p}]) for p in copy_prompts(n, tok, 300, rng)],
        "random": [plain.apply_chat_template([{"role": "user", "content": words.text(250)}]) for _ in range(n)],
    }
    print(f"# {args.method} vs none, {args.dtype}, {machine()}, {time.strftime('%Y-%m-%d')}\n")
    print("| dataset | batch | none tok/s | always tok/s | ratio | accepted / draft tokens | adaptive tok/s | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for name, prompts in sets.items():
        sp = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=name == "random")
        for e in (plain, always, adaptive):
            run(e, prompts[:2], sp)  # warm-up
        for b in batches:
            ta, na = run(plain, prompts[:b], sp)
            before = [(c.draft_tokens, c.accepted_tokens) for c in always.stats.spec.values()]
            tb, nb = run(always, prompts[:b], sp)
            after = [(c.draft_tokens, c.accepted_tokens) for c in always.stats.spec.values()]
            drafted = sum(a[0] for a in after) - sum(x[0] for x in before)
            acc = sum(a[1] for a in after) - sum(x[1] for x in before)
            tc, nc = run(adaptive, prompts[:b], sp)
            base = na / ta
            print(f"| {name} | {b} | {base:.1f} | {nb / tb:.1f} | {nb / tb / base:.2f} | {acc} / {drafted} | "
                  f"{nc / tc:.1f} | {nc / tc / base:.2f} |", flush=True)


if __name__ == "__main__":
    main()
