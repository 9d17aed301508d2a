"""Agentic sessions on a hybrid (Gated DeltaNet) model: tripod beside llama.cpp's ``llama-server``
on the same GGUF, one server at a time (the other one not running).

    PYTHONPATH=$PWD python benchmarks/hybrid_peers.py --llama-server /path/to/build/bin/llama-server

The checkpoint is ``benchmarks/hybrid_context.py``'s hybrid (a random ``Qwen3_5ForCausalLM``, the
same width, depth and seed), converted to an F32 GGUF by llama.cpp's own converter
(``tests/support/llamacpp_convert.py``). Both servers load that file, run float32 weights on the
same number of threads and keep their prefix cache on; each is measured by ``tripod bench
--dataset agentic-sessions --agentic-echo`` with the same sessions (every later turn sends the
previous prompt, the server's own answer token for token — tripod's ``return_token_ids``, llama.cpp's
``return_tokens`` — and a new message). Reported per turn: TTFT p50, and the tokens each server says
it served from its cache (``cached_tokens``) beside the previous prompt + answer.

llama.cpp keeps one conversation per slot (``-np``): a hybrid's recurrent state cannot be cut at an
arbitrary token, so it resumes from the slot's own state or from a context checkpoint, and otherwise
reprocesses the prompt. tripod resumes from the radix cache's state snapshots. Writes
``hybrid_peers.md`` and ``hybrid_peers.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

from hybrid_context import (  # noqa: E402
    _cpu,
    _free_port,
    _wait_ready,
    build_checkpoint,
    model_configs,
    stop_server,
)


def measure(label: str, server: list[str], port: int, tokenizer: Path, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Start ``server``, run the agentic sessions against it, stop it; the bench's summary."""
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    log = open(work / f"serve-{label}.log", "wb")  # closed below, after the process
    proc = subprocess.Popen(server, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    out = work / f"agentic-{label}"
    bench = [sys.executable, "-m", "tripod.cli", "bench", "--base-url", f"{url},label={label}", "--dataset",
             "agentic-sessions", "--agentic-echo", "--tokenizer", str(tokenizer), "--concurrency", "1",
             "--prompts-per-concurrency", str(args.sessions * args.turns), "--turns", str(args.turns),
             "--agentic-scale", str(args.agentic_scale), "--seed", str(args.seed), "--out", str(out)]
    try:
        _wait_ready(url, proc, 300, label)
        subprocess.run(bench, env=env, check=True)
    finally:
        stop_server(proc, log)
    run = json.loads((out / "results.json").read_text())["runs"][0]
    return {"label": label, "server": shlex.join(server), "bench": shlex.join(bench[3:]), "agentic": run["agentic"],
            "completed": run.get("completed"), "failed": run.get("failed")}


def render(data: dict[str, Any]) -> str:
    runs = data["runs"]
    lines = ["# Agentic sessions on a hybrid (Gated DeltaNet) model: tripod and llama.cpp on the same GGUF", "",
             f"- date: {data['date']}", f"- CPU: {data['cpu']} ({data['threads']} thread(s) per server); "
             f"{data['note']}",
             f"- model: {data['model']}", f"- GGUF: F32, from llama.cpp's converter {data['converter']}",
             f"- llama.cpp: `{data['llama_version']}`", "- one server at a time (the other not running); "
             "each measured by `tripod bench`:"]
    for r in runs:
        lines.append(f"  - {r['label']}: `{r['server']}`, `tripod {r['bench']}` — completed {r['completed']}, "
                     f"failed {r['failed']}")
    lines += ["", "| turn | " + " | ".join(f"{r['label']} TTFT p50 ms" for r in runs) + " | "
              + " | ".join(f"{r['label']} cached tokens" for r in runs) + " | previous prompt + answer |",
              "|---|" + "---|" * (2 * len(runs) + 1)]
    turns = sorted({int(t) for r in runs for t in r["agentic"]["ttft_ms_by_turn"]})
    for t in turns:
        ttft = [r["agentic"]["ttft_ms_by_turn"].get(str(t), {}).get("p50") for r in runs]
        reuse = [r["agentic"].get("reuse_by_turn", {}).get(str(t), {}) for r in runs]
        prev = next((u.get("previous_mean") for u in reuse if u.get("previous_mean") is not None), "—")
        lines.append(f"| {t} | " + " | ".join("—" if v is None else f"{v:.0f}" for v in ttft) + " | "
                     + " | ".join(str(u.get("cached_mean", "—")) for u in reuse) + f" | {prev} |")
    lines.append("")
    for r in runs:
        a = r["agentic"]
        reuse = a.get("reuse") or {}
        lines.append(f"- {r['label']}: prefix-cache hit rate (cached / prompt tokens) **{100 * a['cache_hit_rate']:.1f} %**; "
                     f"later turns cached whole (previous prompt + answer but its last token): "
                     f"**{reuse.get('whole_previous', 0)} of {reuse.get('later_turns', 0)}**; "
                     f"TPOT p50 {a.get('tpot_ms', {}).get('p50', float('nan')):.1f} ms.")
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama-server", required=True, help="llama.cpp's llama-server binary")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--agentic-scale", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--note", default="", help="what else ran on the machine")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--work", default=None, help="keep the checkpoint, GGUF, logs and bench outputs here")
    args = ap.parse_args(argv)
    from tests.support.llamacpp_convert import VERSION, convert

    version = subprocess.run([args.llama_server, "--version"], capture_output=True, text=True, timeout=60)
    data: dict[str, Any] = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"), "cpu": _cpu(), "threads": args.threads,
        "note": args.note or "quiet machine", "converter": VERSION,
        "llama_version": next((ln for ln in (version.stdout + version.stderr).splitlines() if ln.startswith("version")), "?"),
        "model": f"Qwen3_5ForCausalLM, hidden {args.hidden}, {args.layers} layers (a quarter attention), "
                 f"{args.heads} heads / {args.kv_heads} KV heads of {args.head_dim}, random weights (benchmarks/hybrid_context.py)",
        "runs": [],
    }
    with tempfile.TemporaryDirectory(prefix="hybrid-peers-") as tmp:
        work = Path(args.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        kw = model_configs(args.hidden, args.layers, args.heads, args.kv_heads, args.head_dim, 49152, 40960)["hybrid"]
        folder = work / "hybrid"
        if not (folder / "config.json").is_file():
            build_checkpoint(kw, folder)
        gguf = work / "hybrid-f32.gguf"
        if not gguf.is_file():
            convert(folder, gguf, "f32", no_mtp=True)
        port = _free_port()
        tripod = [sys.executable, "-m", "tripod.cli", "serve", "--model", str(gguf), "--dtype", "float32", "--port",
                  str(port), "--max-running", "4", "--threads", str(args.threads), "--kernels", "optimized"]
        data["runs"].append(measure("tripod", tripod, port, folder, work, args))
        port = _free_port()
        llama = [args.llama_server, "-m", str(gguf), "--port", str(port), "-t", str(args.threads), "-np", "4",
                 "-c", "32768", "--no-webui"]
        data["runs"].append(measure("llama.cpp", llama, port, folder, work, args))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "hybrid_peers.json").write_text(json.dumps(data, indent=2))
    (out / "hybrid_peers.md").write_text(render(data))
    print(render(data))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
