"""Structured outputs: the per-step cost of grammar masks, and what jump-forward saves.

    python benchmarks/structured_outputs.py [--dtype auto] [--out benchmarks/results/structured_outputs.md]

1. Mask overhead: B requests mid-way through a JSON schema; time of one step's masking work
   (fill every row's bitmask, apply it to the [B, vocab] logits, accept the sampled tokens), next
   to the forward pass of an unconstrained decode step at the same batch size.
2. Jump-forward: the 22-schema suite (tests/support/structured_suite.py), greedy, one request at a time
   and all at once, with jump-forward on and off: forward passes, wall time, identical outputs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from structured_suite import SCHEMAS, json_prompt

from tripod import Engine, SamplingParams
from tripod.engine.structured import GrammarSpec


def mask_overhead(e: Engine, batch: int, reps: int = 30) -> tuple[float, float]:
    schema = json.dumps(SCHEMAS["array-of-objects"])
    compiled = e.grammars.compile_now(GrammarSpec("json", schema))
    prefix = e.tokenizer.encode('{"items": [{"id": 1', add_special_tokens=False)
    matchers = []
    for _ in range(batch):
        m = e.grammars.matcher(compiled)
        for t in prefix:
            assert m.accept_token(t)
        matchers.append(m)
    vocab = e.model_config.vocab_size
    times = []
    for _ in range(reps):
        logits = torch.randn(batch, vocab)
        t0 = time.perf_counter()
        e.grammars.apply_masks(logits, matchers)
        toks = logits.argmax(dim=-1).tolist()
        for m, t in zip(matchers, toks, strict=True):
            assert m.accept_token(t)
        times.append(time.perf_counter() - t0)
        for m in matchers:
            m.rollback(1)
    # The forward of an unconstrained decode step at this batch size, for scale.
    prompts = [e.encode(f"Number {i}: ") for i in range(batch)]
    s0, f0 = e.stats.steps, e.stats.forward_seconds
    e.generate(prompts, SamplingParams(max_tokens=33, temperature=0, ignore_eos=True))
    per_step = (e.stats.forward_seconds - f0) / (e.stats.steps - s0)
    return statistics.median(times), per_step


def suite(e: Engine, jf: bool, batched: bool) -> tuple[list[list[int]], int, float]:
    e.config = replace(e.config, jump_forward=jf)
    e.reset_prefix_cache()
    names = list(SCHEMAS)
    prompts = [e.apply_chat_template(json_prompt(n, SCHEMAS[n])) for n in names]
    params = [SamplingParams(max_tokens=160, temperature=0, grammar=GrammarSpec("json", json.dumps(SCHEMAS[n])))
              for n in names]
    s0 = e.stats.steps
    t0 = time.perf_counter()
    if batched:
        outs = e.generate(prompts, params)
    else:
        outs = [e.generate(p, sp)[0] for p, sp in zip(prompts, params, strict=True)]
    return [o.token_ids for o in outs], e.stats.steps - s0, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    e = Engine(dtype=args.dtype, kv_cache_tokens=32768)
    lines = [f"dtype {e.dtype_name}, torch {torch.__version__}, {torch.get_num_threads()} threads", ""]
    lines += ["| batch | masking per step | forward per step | overhead |", "|---|---|---|---|"]
    for b in (1, 16, 64):
        mask, fwd = mask_overhead(e, b)
        lines.append(f"| {b} | {mask * 1e3:.2f} ms | {fwd * 1e3:.1f} ms | {100 * mask / fwd:.1f} % |")
        print(lines[-1], flush=True)
    lines += ["", "| suite (22 schemas, greedy) | jump-forward | forward passes | wall | outputs identical |",
              "|---|---|---|---|---|"]
    for batched in (False, True):
        off_ids, off_steps, off_t = suite(e, False, batched)
        on_ids, on_steps, on_t = suite(e, True, batched)
        same = sum(a == b for a, b in zip(on_ids, off_ids, strict=True))
        label = "all 22 at once" if batched else "one at a time"
        lines.append(f"| {label} | off | {off_steps} | {off_t:.1f} s | |")
        lines.append(f"| {label} | on | {on_steps} | {on_t:.1f} s | {same}/22 |")
        print("\n".join(lines[-2:]), flush=True)
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
