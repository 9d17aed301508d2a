"""Tensor parallel on this machine: output tok/s of TP=2 (one thread per rank) against one process
with two threads, offline, at C = 1 and C = 16; the time rank 0 spends in collectives per step; and
the KV bytes per token each rank holds for published shapes (DeepSeek-V3's MLA latent is replicated
per rank; GQA's K/V heads are split).

On 2 cores the point is correctness, not speed: two ranks on two cores do the same arithmetic as
one process on two threads plus the all-reduces. The model is a random Llama-shaped checkpoint
(SmolLM2's tokenizer; 12 heads over 4 K/V heads, so T = 2 divides it) built here with transformers.

    .venv/bin/python benchmarks/tensor_parallel.py --out benchmarks/results/tensor_parallel.md
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from tripod import Engine, SamplingParams
from tripod.bench.machine import describe, summary
from tripod.layers.parallel import ParallelGroup
from tripod.loader.embedded import embedded_model_path
from tripod.models.config import ModelConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kv_bytes import CONFIGS

SHAPE = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
             num_key_value_heads=4, max_position_embeddings=2048, tie_word_embeddings=True)


def build_checkpoint(folder: Path) -> Path:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    gguf = embedded_model_path()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), **SHAPE)).eval()
    model.save_pretrained(str(folder))
    tok.save_pretrained(str(folder))
    return folder


def run(folder: Path, concurrency: int, tp: int, dtype: str, prompt_len: int, out_len: int, pp: int = 1) -> dict[str, Any]:
    eng = Engine(model=str(folder), dtype=dtype, kv_cache_tokens=concurrency * (prompt_len + out_len) + 512,
                 tensor_parallel_size=tp, pipeline_parallel_size=pp, num_threads=2 // (tp * pp),
                 max_running=max(16, concurrency))
    try:
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(10, 40000, (prompt_len,), generator=g).tolist() for _ in range(concurrency)]
        params = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
        eng.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm up
        eng.reset_prefix_cache()
        comm = eng.group.tp.comm if eng.group is not None and tp > 1 else None
        c0, steps0 = (comm.seconds if comm else 0.0), eng.stats.steps
        t = time.perf_counter()
        outs = eng.generate(prompts, params)
        wall = time.perf_counter() - t
        steps = eng.stats.steps - steps0
        tokens = sum(len(o.token_ids) for o in outs)
        comm_s = (comm.seconds - c0) if comm else 0.0
        return {"tok_s": tokens / wall, "micro_steps": eng.runner.micro_steps, "steps": steps, "comm_ms_per_step": 1000 * comm_s / max(1, steps),
                "comm_share": comm_s / wall, "compute": eng.runner.describe()}
    finally:
        eng.close()


def kv_table() -> list[str]:
    lines = ["| model | layout | KV bytes per token per rank (bf16) | the group's KV bytes per token held | "
             "tokens the group holds, vs one rank |", "|---|---|---|---|---|"]
    for name, d in CONFIGS.items():
        cfg = ModelConfig.from_hf_dict(d)
        for t in (1, 2, 8):
            per = cfg.pool_spec(ParallelGroup(0, t)).bytes_per_token(torch.bfloat16)
            lines.append(f"| {name} | TP={t} | {per:,} | {per * t:,} | 1x |")
        if cfg.mla is not None:  # data-parallel attention: each rank the latent of its own requests only
            per = cfg.pool_spec().bytes_per_token(torch.bfloat16)
            for dp in (2, 8):
                lines.append(f"| {name} | DP-attention={dp} | {per:,} | {per:,} | {dp}x |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--prompt-len", type=int, default=230)
    ap.add_argument("--out-len", type=int, default=64)
    ap.add_argument("--no-pipeline", dest="pipeline", action="store_false", help="skip the PP=2 rows")
    args = ap.parse_args()
    lines = ["# Tensor parallel on 2 cores", "",
             f"Date: {time.strftime('%Y-%m-%d')}. Machine: {summary(describe())} ({platform.machine()}).",
             f"Command: `{' '.join(['.venv/bin/python', *sys.argv])}`", "",
             f"Model: a random Llama-shaped checkpoint ({SHAPE}, SmolLM2's vocabulary), offline `Engine.generate`, "
             f"{args.prompt_len}-token prompts, {args.out_len} tokens out, greedy. One process: 2 torch threads; "
             "TP=2: two processes of 1 thread each. Comm = rank 0's time in all-reduce / all-gather.", "",
             "| dtype | C | one process tok/s | TP=2 tok/s | TP=2 / one | comm ms per step (share of wall) | compute |",
             "|---|---|---|---|---|---|---|"]
    piped = ["", "## Pipeline parallel (PP=2, micro-batches)", "",
             "Two stages of one thread each against one process of two threads; a step with several "
             "requests runs as two micro-batches, so the stages overlap.", "",
             "| dtype | C | one process tok/s | PP=2 tok/s | PP=2 / one | micro-batched steps |", "|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_checkpoint(Path(tmp) / "llama")
        for dtype in args.dtypes.split(","):
            for c in (1, 16):
                one = run(folder, c, 1, dtype, args.prompt_len, args.out_len)
                two = run(folder, c, 2, dtype, args.prompt_len, args.out_len)
                lines.append(f"| {dtype} | {c} | {one['tok_s']:.1f} | {two['tok_s']:.1f} | {two['tok_s'] / one['tok_s']:.2f} "
                             f"| {two['comm_ms_per_step']:.2f} ({100 * two['comm_share']:.0f} %) | {two['compute']} |")
                print(lines[-1], flush=True)
                if args.pipeline:
                    pipe = run(folder, c, 1, dtype, args.prompt_len, args.out_len, pp=2)
                    piped.append(f"| {dtype} | {c} | {one['tok_s']:.1f} | {pipe['tok_s']:.1f} | "
                                 f"{pipe['tok_s'] / one['tok_s']:.2f} | {pipe['micro_steps']} of {pipe['steps']} |")
                    print(piped[-1], flush=True)
    if args.pipeline:
        lines += piped
    lines += ["", "## KV bytes per token per rank", "",
              "Under tensor parallel MLA's latent is replicated on every rank; with data-parallel attention "
              "(`--data-parallel-size D`) each rank holds the latent of its own requests only, so the group "
              "holds D times the tokens. GQA's K/V heads are split (replicated once T exceeds them).", "",
              *kv_table()]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
