"""Offline throughput of the engine core, next to Hugging Face ``generate`` in the same run.

Closed batch: C requests submitted at once, prompt ~256 tokens, exactly 128 new tokens
(ignore_eos), greedy. Output tokens/s = C*128 / wall time from submission to the last token.
Writes a Markdown table and JSON with machine info to ``benchmarks/results/``.

    .venv/bin/python benchmarks/offline_throughput.py                 # full table (~10 min)
    .venv/bin/python benchmarks/offline_throughput.py --concurrency 1,8 --dtypes bfloat16 --no-hf
    .venv/bin/python benchmarks/offline_throughput.py --profile 32   # one decode step's profile
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

import torch

from tripod import Engine, SamplingParams

ROOT = Path(__file__).resolve().parent
PROMPT_LEN = 256
NEW_TOKENS = 128


def machine_info() -> dict[str, object]:
    cpu = "unknown"
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and cpu == "unknown":
                cpu = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "avx512_bf16": "avx512_bf16" in flags,
        "amx": "amx_bf16" in flags,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
    }


def make_prompts(engine: Engine, n: int, seed: int) -> list[list[int]]:
    """Natural-looking text prompts of exactly PROMPT_LEN tokens (distinct per request)."""
    rng = random.Random(seed)
    words = (
        "the a of to and in for on with as at by from this that model data time system user "
        "request server memory cache token batch latency throughput engine river mountain city "
        "music garden history science language people world number question answer light"
    ).split()
    out = []
    for i in range(n):
        text = f"Story {i}: " + " ".join(rng.choice(words) for _ in range(PROMPT_LEN * 2))
        ids = engine.encode(text)[:PROMPT_LEN]
        out.append(ids)
    return out


def run_tripod(engine: Engine, prompts: list[list[int]]) -> tuple[float, float]:
    engine.reset_prefix_cache()
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    dt = time.perf_counter() - t0
    n = sum(len(o.token_ids) for o in outs)
    assert n == len(prompts) * NEW_TOKENS
    return n / dt, dt


def run_hf(model: object, prompts: list[list[int]], pad_id: int) -> tuple[float, float]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as HF expects for generation
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(  # type: ignore[attr-defined]
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=pad_id,
        )
    dt = time.perf_counter() - t0
    n = (out.shape[1] - width) * len(prompts)
    return n / dt, dt


def profile_step(engine: Engine, batch: int) -> str:
    from torch.profiler import ProfilerActivity, profile

    prompts = make_prompts(engine, batch, seed=1)
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
    while any(not r.output_ids for r in engine.scheduler.running + engine.scheduler.waiting):
        engine.step()
    for _ in range(3):
        engine.step()
    t0 = time.perf_counter()
    for _ in range(10):
        engine.step()
    ms = (time.perf_counter() - t0) / 10 * 1000
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            engine.step()
    while engine.has_work:
        engine.step()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)
    return f"decode step at batch {batch}: {ms:.1f} ms ({batch / ms * 1000:.0f} tok/s)\n{table}"


def _median(runs: list[tuple[float, float]]) -> tuple[float, float]:
    """The run with the median throughput, the lower middle one for an even count (this
    machine's memory bandwidth varies run to run)."""
    runs = sorted(runs)
    return runs[(len(runs) - 1) // 2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="1,8,32,64")
    ap.add_argument("--dtypes", default="float32,bfloat16",
                    help="comma-separated; 'stored' = --weights stored (GGUF Q4_1/Q8_0 as stored, fp32 compute)")
    ap.add_argument("--kernels", default="auto", help="auto | eager | optimized (EngineConfig.kernels)")
    ap.add_argument("--no-hf", action="store_true", help="skip the Hugging Face generate baseline")
    ap.add_argument("--hf-max-batch", type=int, default=64)
    ap.add_argument("--profile", type=int, default=0, help="profile one decode step at this batch")
    ap.add_argument("--repeat", type=int, default=2, help="runs per cell; the median is reported")
    ap.add_argument("--out", default=str(ROOT / "results"))
    args = ap.parse_args()
    conc = [int(c) for c in args.concurrency.split(",")]
    dtypes = args.dtypes.split(",")
    info = machine_info()
    print(json.dumps(info), flush=True)
    rows: list[dict[str, object]] = []
    for dt in dtypes:
        extra = {"weights": "stored", "dtype": "auto"} if dt == "stored" else {"dtype": dt}
        engine = Engine(kv_cache_tokens=65536, max_running=128, max_batch_tokens=512, kernels=args.kernels, **extra)
        if args.profile:
            print(profile_step(engine, args.profile), flush=True)
            continue
        run_tripod(engine, make_prompts(engine, 2, seed=99))  # warm-up
        for c in conc:
            tps, secs = _median([run_tripod(engine, make_prompts(engine, c, seed=c)) for _ in range(args.repeat)])
            rows.append({"engine": "tripod", "dtype": dt, "concurrency": c, "tok_s": round(tps, 1), "seconds": round(secs, 1)})
            print(rows[-1], flush=True)
        if not args.no_hf and dt != "stored":
            from transformers import AutoModelForCausalLM

            path = Path(engine.loaded.path)
            hf = AutoModelForCausalLM.from_pretrained(
                str(path.parent), gguf_file=path.name, dtype=engine.dtype
            ).eval()
            pad = engine.tokenizer.pad_token_id or 0
            run_hf(hf, make_prompts(engine, 1, seed=99), pad)
            for c in conc:
                if c > args.hf_max_batch:
                    continue
                tps, secs = _median([run_hf(hf, make_prompts(engine, c, seed=c), pad) for _ in range(args.repeat)])
                rows.append({"engine": "hf-generate", "dtype": dt, "concurrency": c, "tok_s": round(tps, 1), "seconds": round(secs, 1)})
                print(rows[-1], flush=True)
            del hf
        del engine
    if args.profile or not rows:
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    (out / f"offline_throughput-{stamp}.json").write_text(json.dumps({"machine": info, "rows": rows}, indent=2))
    lines = [
        "# Offline throughput (output tokens/s)",
        "",
        f"Machine: {info['cpu']}, {info['cores']} cores, torch {info['torch']} ({info['torch_threads']} threads), {info['date']}.",
        f"Prompt {PROMPT_LEN} tokens, {NEW_TOKENS} new tokens (ignore_eos), greedy, C requests submitted at once; "
        f"median (lower middle) of {args.repeat} runs. tok/s = output tokens / wall time from submission to the last token (prefill included).",
        f"Command: `{' '.join([Path(sys.executable).name, *sys.argv])}`",
        "",
        "| engine | dtype | " + " | ".join(f"C={c}" for c in conc) + " |",
        "|---|---|" + "---|" * len(conc),
    ]
    for eng in ("tripod", "hf-generate"):
        for dt in dtypes:
            cells = []
            for c in conc:
                r = [x for x in rows if x["engine"] == eng and x["dtype"] == dt and x["concurrency"] == c]
                cells.append(str(r[0]["tok_s"]) if r else "–")
            if any(c != "–" for c in cells):
                lines.append(f"| {eng} | {dt} | " + " | ".join(cells) + " |")
    (out / "offline_throughput.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
