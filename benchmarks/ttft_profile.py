"""Where a turn's time to first token goes, through the offline Engine on the embedded model:
one cold prompt, then an agentic conversation alone (a first prompt, then turns that each add
new tokens to the cached conversation), each request with one generated token.

    PYTHONPATH=$PWD python benchmarks/ttft_profile.py [--cold 1500] [--first 1566] [--turns 4]
        [--add 320] [--chunk-size 256] [--max-batch-tokens 512] [--json OUT] [--label NAME]

Each request runs under torch's profiler; its wall time is split into the linears (tripod's
``linear_packed``/stored kernels and torch matmuls, the lm head excepted), the attention kernel
(``paged_attention``), the lm head (timed as its own range) and everything else (wall time minus
those three: norms, RoPE, activations, Python in the scheduler, batch building and sampling).
The engine runs its defaults (stored Q4_1 blocks, bf16 activations, the best kernel level)
unless told otherwise. Prompts are ordinary vocabulary ids (content does not change the work).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from tripod import Engine, SamplingParams

LINEAR_OPS = ("linear_packed", "linear_stored", "stored_linear", "aten::mm", "aten::addmm", "aten::linear",
              "mkldnn", "onednn")
ATTENTION_OPS = ("paged_attention", "attention")


def ids(engine: Engine, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, min(engine.model_config.vocab_size, 40000), (n,), generator=g).tolist()


def label_head(engine: Engine) -> None:
    """Run the lm head inside a ``lm_head`` profiler range (its own share of the wall time)."""
    model = engine.runner.model

    class Timed:
        def __init__(self, op: Any) -> None:
            self.op = op

        def __call__(self, x: torch.Tensor) -> torch.Tensor:
            with record_function("lm_head"):
                return self.op(x)

    ops = model.head_ops

    class Wrapping(dict):  # type: ignore[type-arg]
        def __getitem__(self, key: str) -> Any:
            return Timed(dict.__getitem__(self, key))

    model.head_ops = Wrapping(ops)


def breakdown(prof: Any, wall: float) -> dict[str, float]:
    """Seconds of ``wall`` in the linears, the attention, the lm head and everything else."""
    linear = attention = head = head_inner = 0.0
    for e in prof.key_averages():
        name = e.key
        if name == "lm_head":
            head += e.cpu_time_total / 1e6
        elif any(k in name for k in ATTENTION_OPS):
            attention += e.self_cpu_time_total / 1e6
        elif any(k in name for k in LINEAR_OPS):
            linear += e.self_cpu_time_total / 1e6
    # the head's own linear is inside the lm_head range: take it out of the linears
    for e in prof.events():
        if e.name == "lm_head":
            for c in e.cpu_children:
                if any(k in c.name for k in LINEAR_OPS):
                    head_inner += c.cpu_time_total / 1e6
    linear -= head_inner
    return {"wall": wall, "linears": linear, "attention": attention, "lm_head": head,
            "other": wall - linear - attention - head}


def timed(engine: Engine, prompt: list[int], params: SamplingParams, use_profiler: bool) -> tuple[list[int], dict[str, float]]:
    if not use_profiler:
        t0, c0 = time.perf_counter(), time.process_time()
        out = engine.generate([prompt], params)[0]
        return list(out.token_ids), {"wall": time.perf_counter() - t0, "cpu": time.process_time() - c0}
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        out = engine.generate([prompt], params)[0]
        wall = time.perf_counter() - t0
    return list(out.token_ids), breakdown(prof, wall)


def run(args: argparse.Namespace) -> dict[str, Any]:
    overrides: dict[str, Any] = {"chunk_size": args.chunk_size, "max_batch_tokens": args.max_batch_tokens}
    if args.threads:
        overrides["num_threads"] = args.threads
    engine = Engine(kv_cache_tokens=max(16384, args.first + args.turns * (args.add + 8) + args.cold + 64), **overrides)
    label_head(engine)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    engine.generate([ids(engine, 300, 1)], params)  # warm-up: kernels loaded, caches allocated
    engine.reset_prefix_cache()
    result: dict[str, Any] = {"cold": [], "turns": []}
    for r in range(args.repeats):
        engine.reset_prefix_cache()
        _, b = timed(engine, ids(engine, args.cold, 2 + r), params, not args.no_profiler)
        result["cold"].append(b)
    for r in range(args.repeats):
        engine.reset_prefix_cache()
        prompt = ids(engine, args.first, 100 + r)
        rows = []
        for t in range(args.turns + 1):
            if t:
                prompt = prompt + ids(engine, args.add, 1000 * r + t)
            out, b = timed(engine, prompt, params, not args.no_profiler)
            b["prompt"] = len(prompt)
            rows.append(b)
            prompt = prompt + out  # the next turn extends the conversation, the answer included
        result["turns"].append(rows)
    engine.close()
    return result


def compare_chunks(args: argparse.Namespace) -> list[str]:
    """Chunk sizes A/B, interleaved in one process (engines sharing the loaded model): per request,
    the process's CPU time (robust on a shared machine with ``--threads 1``) and its wall time."""
    sizes = [int(c) for c in args.chunks.split(",")]
    overrides: dict[str, Any] = {"num_threads": args.threads} if args.threads else {}
    kv = max(16384, args.first + args.turns * (args.add + 8) + args.cold + 64)
    engines: dict[int, Engine] = {}
    for c in sizes:
        loaded = next(iter(engines.values())).loaded if engines else None
        engines[c] = Engine(kv_cache_tokens=kv, loaded=loaded, chunk_size=c,
                            max_batch_tokens=max(args.max_batch_tokens, c), **overrides)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for e in engines.values():
        e.generate([ids(e, 300, 1)], params)
    cpu: dict[tuple[int, str], list[float]] = {}
    wall: dict[tuple[int, str], list[float]] = {}
    answers: dict[tuple[int, str], set[tuple[int, ...]]] = {}

    def one(c: int, what: str, prompt: list[int]) -> list[int]:
        c0, t0 = time.process_time(), time.perf_counter()
        out = list(engines[c].generate([prompt], params)[0].token_ids)
        cpu.setdefault((c, what), []).append(time.process_time() - c0)
        wall.setdefault((c, what), []).append(time.perf_counter() - t0)
        answers.setdefault((len(cpu[(c, what)]), what), set()).add(tuple(out))
        return out

    for r in range(args.repeats):
        cold = ids(engines[sizes[0]], args.cold, 2 + r)
        for c in sizes:
            engines[c].reset_prefix_cache()
            one(c, "cold", cold)
        for c in sizes:
            engines[c].reset_prefix_cache()
            prompt = ids(engines[c], args.first, 100 + r)
            for t in range(args.turns + 1):
                if t:
                    prompt = prompt + ids(engines[c], args.add, 1000 * r + t)
                prompt = prompt + one(c, f"turn {t}", prompt)
    assert all(len(v) == 1 for v in answers.values()), "a chunk size changed a greedy token"
    whats = ["cold"] + [f"turn {t}" for t in range(args.turns + 1)]
    lines = ["| chunk size | " + " | ".join(f"{w} CPU s / wall s" for w in whats) + " |", "|---|" + "---|" * len(whats)]
    for c in sizes:
        lines.append(f"| {c} | " + " | ".join(
            f"{statistics.median(cpu[(c, w)]):.3f} / {statistics.median(wall[(c, w)]):.3f}" for w in whats) + " |")
    for e in engines.values():
        e.close()
    return lines


def summarize(res: dict[str, Any]) -> list[str]:
    keys = [k for k in ("wall", "cpu", "linears", "attention", "lm_head", "other") if k in res["cold"][0]]

    def med(rows: list[dict[str, float]], k: str) -> float:
        return statistics.median(r[k] for r in rows)

    lines = ["| request | " + " | ".join(f"{k} (ms)" for k in keys) + " |", "|---|" + "---|" * len(keys)]
    lines.append("| cold | " + " | ".join(f"{1000 * med(res['cold'], k):.0f}" for k in keys) + " |")
    for t in range(len(res["turns"][0])):
        rows = [rep[t] for rep in res["turns"]]
        lines.append(f"| turn {t} ({rows[0]['prompt']} tok) | " + " | ".join(f"{1000 * med(rows, k):.0f}" for k in keys) + " |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cold", type=int, default=1500)
    ap.add_argument("--first", type=int, default=1566)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--add", type=int, default=320)
    ap.add_argument("--chunk-size", type=int, default=256)
    ap.add_argument("--max-batch-tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-profiler", action="store_true", help="wall times only")
    ap.add_argument("--json", default=None, help="append the results to this JSON file")
    ap.add_argument("--label", default="")
    ap.add_argument("--chunks", default=None, help="A/B chunk sizes instead, e.g. 256,512,1024 (wall and CPU time)")
    args = ap.parse_args()
    if args.chunks:
        print("\n".join(compare_chunks(args)))
        return
    res = run(args)
    print("\n".join(summarize(res)))
    if args.json:
        path = Path(args.json)
        data = json.loads(path.read_text()) if path.exists() else []
        data.append({"label": args.label, "date": datetime.now(UTC).isoformat(timespec="seconds"),
                     "cpu": platform.processor(), "threads": torch.get_num_threads(), "args": vars(args), **res})
        path.write_text(json.dumps(data, indent=1) + "\n")


if __name__ == "__main__":
    main()
