"""The cost of LoRA: output tok/s of requests spread over N adapters against the base model alone,
at the same load, in one engine (the embedded SmolLM2-135M by default).

    .venv/bin/python benchmarks/lora_cost.py                      # N = 0 (base), 1, 4, 8; 8 requests at once
    .venv/bin/python benchmarks/lora_cost.py --adapters 0,4 --concurrency 16 --max-tokens 64

Adapters are random PEFT folders of the model's shape (rank ``--rank``; ``--modules``: every
projection of every layer, q, k, v, o, gate, up, down, or those named) written here; ``--concurrency`` requests of
``--prompt-len`` random tokens decode ``--max-tokens`` tokens each (``ignore_eos``), round-robin over
the adapters, after one warm-up round. Each batch mixes every adapter (a step runs one base forward
plus a gathered pair of matmuls per adapter present per projection). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.support.lora_adapters import random_adapter  # noqa: E402
from tripod import Engine, SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--adapters", default="0,1,4,8", help="adapter counts to measure (0: the base model alone)")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--modules", default="all", help="all (every projection) or a comma list, e.g. q_proj,v_proj")
    args = ap.parse_args()
    counts = [int(x) for x in args.adapters.split(",")]
    modules = None if args.modules == "all" else tuple(args.modules.split(","))
    tmp = Path(tempfile.mkdtemp(prefix="lora-cost-"))
    probe = Engine(model=args.model, dtype=args.dtype, kv_cache_tokens=256, kernels="eager")
    cfg = probe.model_config
    del probe
    most = max(counts)
    for i in range(most):
        random_adapter(tmp / f"a{i}", cfg, args.rank, seed=i, scale=0.01, modules=modules)
    spec = ",".join(f"a{i}={tmp / f'a{i}'}" for i in range(most)) or None
    eng = Engine(model=args.model, dtype=args.dtype, lora=spec, max_loras=max(most, 1),
                 kv_cache_tokens=args.concurrency * (args.prompt_len + args.max_tokens) * 2 + 512)
    g = torch.Generator().manual_seed(0)
    vocab = cfg.vocab_size
    base_rate = None
    print(f"{eng.model_name} ({eng.dtype_name}, {eng.runner.describe()}); {args.concurrency} requests at once, "
          f"{args.prompt_len} prompt + {args.max_tokens} output tokens each, adapters of rank {args.rank} on "
          f"{'every projection' if modules is None else ', '.join(modules)}")
    print()
    print("| adapters in the batch | output tok/s | vs the base alone |")
    print("|---|---|---|")
    for n in counts:
        names = [f"a{i}" for i in range(n)] or [None]

        def batch(names: list[str | None] = names) -> tuple[list[list[int]], list[SamplingParams]]:
            prompts = [torch.randint(10, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.concurrency)]
            params = [SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True,
                                     lora=names[i % len(names)]) for i in range(args.concurrency)]
            return prompts, params

        eng.generate(*batch())  # warm-up (and every adapter made resident)
        prompts, params = batch()
        t0 = time.perf_counter()
        outs = eng.generate(prompts, params)
        dt = time.perf_counter() - t0
        rate = sum(len(o.token_ids) for o in outs) / dt
        base_rate = base_rate if base_rate is not None else (rate if n == 0 else None)
        rel = f"{rate / base_rate:.2f}x" if base_rate else "-"
        print(f"| {n or 'none (base)'} | {rate:.1f} | {rel} |", flush=True)


if __name__ == "__main__":
    main()
