"""The hybrid mixers' token recurrences on tripod's CPU kernels (``kernels/csrc/recurrent.cpp``)
against the same engine running them as torch loops (the reference code in ``layers/``): prefill
time of a long prompt and decode TPOT, interleaved in one process.

    PYTHONPATH=$PWD python benchmarks/hybrid_recurrent_kernels.py --models qwen3_5,nemotron_h,kimi_linear  # recorded
    PYTHONPATH=$PWD python benchmarks/hybrid_recurrent_kernels.py --context 128 --reps 1 --out /tmp/hrk

One engine per model (``--kernels optimized``, float32, one torch thread): per repeat, the two
paths alternate (kernels first on even repeats, torch first on odd ones) by switching the
backend's ``recurrent_kernels`` between steps; everything else (projections, attention, norms) is
the same kernels either way. Each run is one request of ``--context`` random prompt tokens that
generates ``--decode`` tokens greedily: prefill = time to the first token, TPOT = the median of the
decode steps; then ``--batch`` requests of ``--batch-context`` tokens decode together (the torch
loops run one sequence at a time, the kernels one call per layer): the median step. Wall-clock and
this process's CPU time (with one thread the step's own cost on a shared machine). Medians over ``--reps``; ratios torch / kernels. The greedy tokens of both paths
are compared (they agree to float32 rounding, so a random model's tokens should match).

Models (random weights, transformers configs, float32): the Qwen3.5 hybrid of
``benchmarks/hybrid_context.py`` (3 Gated DeltaNet layers per gated-attention layer), a Nemotron-H
of the same width (Mamba2 layers beside attention and MLP blocks) and a Kimi Linear (KDA on 3 of
every 4 layers, MLA on the 4th).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from hybrid_context import _cpu, build_checkpoint, model_configs  # noqa: E402


def nemotron_config(hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int, vocab: int,
                    max_len: int) -> dict[str, Any]:
    """A Nemotron-H of ``layers`` blocks: Mamba2 (M), attention (*) and MLP (-) in the pattern
    ``M-M*`` repeated (half the blocks Mamba2)."""
    pattern = ("M-M*" * layers)[:layers]
    return dict(model_type="nemotron_h", vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                num_hidden_layers=layers, hybrid_override_pattern=pattern, num_attention_heads=heads,
                num_key_value_heads=kv_heads, head_dim=head_dim, mamba_num_heads=hidden // 16, mamba_head_dim=32,
                ssm_state_size=64, n_groups=1, conv_kernel=4, max_position_embeddings=max_len,
                bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)


def kimi_config(hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int, vocab: int,
                max_len: int) -> dict[str, Any]:
    """A Kimi Linear of ``layers`` layers: KDA on three of every four, MLA on the fourth, dense MLPs."""
    types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    return dict(model_type="kimi_linear", vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                moe_intermediate_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=heads, kv_lora_rank=2 * head_dim, q_lora_rank=None, qk_rope_head_dim=head_dim // 2,
                qk_nope_head_dim=head_dim, v_head_dim=head_dim, num_local_experts=4, num_experts_per_tok=2,
                n_shared_experts=1, n_group=1, topk_group=1, layer_types=types, mlp_layer_types=["dense"] * layers,
                linear_attn_config={"head_dim": head_dim, "num_heads": heads, "short_conv_kernel_size": 4},
                max_position_embeddings=max_len, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                tie_word_embeddings=False)


def _run_once(engine: Any, context: int, decode: int, seed: int, requests: int = 1) -> dict[str, Any]:
    """``requests`` requests of ``context`` prompt tokens each: the prefill (time until every one has
    its first token) and the median of the decode steps after it, wall and CPU."""
    from tripod import SamplingParams

    g = torch.Generator().manual_seed(seed)
    reqs = []
    for _ in range(requests):
        prompt = torch.randint(3, engine.model_config.vocab_size, (context,), generator=g).tolist()
        reqs.extend(engine.add_request(prompt, SamplingParams(max_tokens=decode + 1, temperature=0.0, ignore_eos=True)))
    t0, c0 = time.perf_counter(), time.process_time()
    steps: list[float] = []
    cpu: list[float] = []
    first: tuple[float, float] | None = None
    tokens: dict[int, list[int]] = {}
    while engine.has_work:
        t, c = time.perf_counter(), time.process_time()
        outs = engine.step()
        dt, dc = time.perf_counter() - t, time.process_time() - c
        for o in outs:
            tokens.setdefault(id(o.req), []).extend(o.new_token_ids)
        if first is None:
            if len(tokens) == requests and all(tokens.values()):
                first = (time.perf_counter() - t0, time.process_time() - c0)
        else:
            steps.append(dt)
            cpu.append(dc)
    assert first is not None
    return {"prefill_s": first[0], "prefill_cpu_s": first[1], "tpot_ms": statistics.median(steps) * 1e3,
            "tpot_cpu_ms": statistics.median(cpu) * 1e3, "tokens": [tokens[id(r)] for r in reqs]}


def measure(folder: Path, context: int, decode: int, reps: int, chunk: int, batch: int,
            batch_context: int) -> dict[str, Any]:
    from tripod import Engine

    top = max(context, batch_context) + decode + 16
    eng = Engine(model=str(folder), dtype="float32", max_running=batch, kv_cache_tokens=top * batch, max_model_len=top,
                 chunk_size=chunk, enable_prefix_cache=False, num_threads=1, kernels="optimized")
    try:
        backend = eng.runner.backend
        if not type(backend).recurrent_kernels:
            raise SystemExit(f"the engine runs {backend.describe()}: no recurrent kernels to compare")
        samples: dict[str, list[dict[str, Any]]] = {"kernels": [], "torch": []}
        _run_once(eng, 64, 2, seed=1, requests=batch)  # warm-up (weights packed, first-call costs)
        for rep in range(reps):
            order = ("kernels", "torch") if rep % 2 == 0 else ("torch", "kernels")
            for mode in order:
                backend.recurrent_kernels = mode == "kernels"  # (instance attribute over the class's)
                s = _run_once(eng, context, decode, seed=100 + rep)
                many = _run_once(eng, batch_context, decode, seed=200 + rep, requests=batch)
                s.update({f"batch_{k}": many[k] for k in ("tpot_ms", "tpot_cpu_ms")})
                s["tokens"] = [*s["tokens"], *many["tokens"]]
                samples[mode].append(s)
                print(f"  {folder.name} rep {rep} {mode:7s}: prefill {s['prefill_s']:.3f} s (CPU {s['prefill_cpu_s']:.3f}), "
                      f"TPOT {s['tpot_ms']:.2f} ms (CPU {s['tpot_cpu_ms']:.2f}), {batch} sequences: step "
                      f"{many['tpot_ms']:.2f} ms (CPU {many['tpot_cpu_ms']:.2f})", flush=True)
        del backend.recurrent_kernels
    finally:
        eng.close()
    out: dict[str, Any] = {"model": folder.name, "reps": reps}
    for mode, runs in samples.items():
        for key in ("prefill_s", "prefill_cpu_s", "tpot_ms", "tpot_cpu_ms", "batch_tpot_ms", "batch_tpot_cpu_ms"):
            out[f"{mode}_{key}"] = statistics.median(r[key] for r in runs)
            out[f"{mode}_{key}_all"] = [round(r[key], 4) for r in runs]
    same = [a["tokens"] == b["tokens"] for a, b in zip(samples["kernels"], samples["torch"], strict=True)]
    out["tokens_equal"] = f"{sum(same)} of {len(same)}"
    return out


def render(data: dict[str, Any]) -> str:
    lines = ["# Hybrid recurrences: tripod's CPU kernels vs the torch token loops", "",
             f"- date: {data['date']}", f"- command: `{data['command']}`",
             f"- CPU: {data['cpu']} ({data['cores']} cores visible, torch threads 1, `--kernels optimized`); "
             "shared machine: other jobs ran on the same cores",
             f"- load average before / after: {data['load_before']} / {data['load_after']}",
             f"- one request of {data['context']} prompt tokens (prefill chunk {data['chunk']}), then {data['decode']} "
             f"decoded tokens (TPOT: the median decode step); then {data['batch']} requests of {data['batch_context']} "
             f"prompt tokens decoding together ({data['batch']}-sequence step: the median decode step once all "
             f"decode); the two paths alternate in one process, {data['reps']} repeats each, medians", "",
             "| model | prefill s kernels (CPU) | prefill s torch (CPU) | prefill ratio (CPU) "
             "| TPOT ms kernels (CPU) | TPOT ms torch (CPU) | TPOT ratio (CPU) "
             f"| {data['batch']}-sequence step ms kernels (CPU) | torch (CPU) | ratio (CPU) | greedy tokens equal |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        lines.append(
            f"| {r['model']} | {r['kernels_prefill_s']:.3f} ({r['kernels_prefill_cpu_s']:.3f}) "
            f"| {r['torch_prefill_s']:.3f} ({r['torch_prefill_cpu_s']:.3f}) "
            f"| {r['torch_prefill_s'] / r['kernels_prefill_s']:.1f}× ({r['torch_prefill_cpu_s'] / r['kernels_prefill_cpu_s']:.1f}×) "
            f"| {r['kernels_tpot_ms']:.2f} ({r['kernels_tpot_cpu_ms']:.2f}) | {r['torch_tpot_ms']:.2f} ({r['torch_tpot_cpu_ms']:.2f}) "
            f"| {r['torch_tpot_ms'] / r['kernels_tpot_ms']:.2f}× ({r['torch_tpot_cpu_ms'] / r['kernels_tpot_cpu_ms']:.2f}×) "
            f"| {r['kernels_batch_tpot_ms']:.2f} ({r['kernels_batch_tpot_cpu_ms']:.2f}) "
            f"| {r['torch_batch_tpot_ms']:.2f} ({r['torch_batch_tpot_cpu_ms']:.2f}) "
            f"| {r['torch_batch_tpot_ms'] / r['kernels_batch_tpot_ms']:.2f}× "
            f"({r['torch_batch_tpot_cpu_ms'] / r['kernels_batch_tpot_cpu_ms']:.2f}×) "
            f"| {r['tokens_equal']} |")
    lines += ["", "Ratios are torch / kernels (> 1: the kernels are faster). Models: " + data["models_text"], ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, default=1024, help="prompt tokens")
    ap.add_argument("--decode", type=int, default=32, help="decoded tokens per request")
    ap.add_argument("--reps", type=int, default=4, help="runs per path (alternating)")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--chunk-size", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8, help="sequences decoding together in the batched run")
    ap.add_argument("--batch-context", type=int, default=64, help="prompt tokens of each batched request")
    ap.add_argument("--models", default="qwen3_5,nemotron_h,kimi_linear", help="comma-separated: qwen3_5, nemotron_h, kimi_linear")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="folder for hybrid_recurrent_kernels.{md,json}")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    max_len = args.context + args.decode + 64
    dims = (args.hidden, args.layers, args.heads, args.kv_heads, args.head_dim, 49152, max_len)
    cfgs = {"qwen3_5": model_configs(*dims)["hybrid"], "nemotron_h": nemotron_config(*dims),
            "kimi_linear": kimi_config(*dims)}
    names = [m for m in args.models.split(",") if m]
    data: dict[str, Any] = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": ("python benchmarks/hybrid_recurrent_kernels.py " + shlex.join(sys.argv[1:] if argv is None else argv)).strip(),
        "cpu": _cpu(), "cores": os.cpu_count(), "load_before": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "context": args.context, "decode": args.decode, "batch": args.batch, "batch_context": args.batch_context, "reps": args.reps, "chunk": args.chunk_size,
        "configs": {n: cfgs[n] for n in names},
        "models_text": (f"hidden {args.hidden}, {args.layers} layers, {args.heads} heads / {args.kv_heads} KV heads of "
                        f"{args.head_dim}, vocab 49152; qwen3_5: `Qwen3_5ForCausalLM`, 3 Gated DeltaNet layers per "
                        f"gated-attention layer (value heads {args.heads}, key heads {args.kv_heads}, head size "
                        f"{args.head_dim}); nemotron_h: `NemotronHForCausalLM`, blocks `M-M*` repeated (Mamba2 "
                        f"{args.hidden // 16} heads of 32, state 64); kimi_linear: `KimiLinearForCausalLM`, KDA on 3 of every 4 "
                        f"layers ({args.heads} heads of {args.head_dim}), MLA on the 4th, dense MLPs."),
        "rows": [],
    }
    with tempfile.TemporaryDirectory(prefix="hybrid-rk-") as tmp:
        for name in names:
            folder = build_checkpoint(cfgs[name], Path(tmp) / name)
            data["rows"].append(measure(folder, args.context, args.decode, args.reps, args.chunk_size,
                                        args.batch, args.batch_context))
    data["load_after"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    md = render(data)
    (out / "hybrid_recurrent_kernels.md").write_text(md)
    (out / "hybrid_recurrent_kernels.json").write_text(json.dumps(data, indent=1) + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
