"""The linears of one decode step of the embedded model (30 layers' QKV / O / gate-up / down and the
LM head: 134.5 M weights, 269 MB in bf16), timed alone for each way tripod can run them:

- eager ``F.linear`` (oneDNN reorders the plain weight on every call);
- oneDNN with the weight packed once (``onednn`` form, the fallback while the kernels build);
- tripod's kernel over bf16 weights (``kernel`` form);
- tripod's kernel over the GGUF's Q4_1 / Q8_0 blocks as stored, float32 activations (``stored``).

Best of ``--reps`` runs per cell, ms per step (and the weight bytes streamed per second).

    .venv/bin/python benchmarks/linear_kernels.py --rows 1,8,32,64,256
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from offline_throughput import machine_info

from tripod import kernels
from tripod.loader.embedded import embedded_model_path
from tripod.loader.gguf_reader import GGUFMetadataReader


def bench(fn: Callable[[], object], reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,8,32,64,256")
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    if not kernels.load(wait=True):
        print(f"tripod's kernels are unavailable: {kernels.unavailable_reason()}", file=sys.stderr)
        return 1
    ops = kernels.ops()
    reader = GGUFMetadataReader(embedded_model_path())
    t = {x.name: x for x in reader.tensors}
    names = [f"blk.{i}.{n}" for i in range(30) for n in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")]
    # The model's fused projections: QKV and gate/up concatenated along the outputs.
    groups = [[f"blk.{i}.attn_q", f"blk.{i}.attn_k", f"blk.{i}.attn_v"] for i in range(30)]
    groups += [[f"blk.{i}.attn_output"] for i in range(30)]
    groups += [[f"blk.{i}.ffn_gate", f"blk.{i}.ffn_up"] for i in range(30)]
    groups += [[f"blk.{i}.ffn_down"] for i in range(30)]
    assert len(names) == sum(len(g) for g in groups)
    stored = []
    for g in groups:
        raw = torch.from_numpy(np.concatenate([np.ascontiguousarray(t[n + ".weight"].data) for n in g]).copy())
        n, k = raw.shape[0], int(t[g[0] + ".weight"].shape[0])
        stored.append((ops.pack_linear(raw, "q4_1", n, k), "q4_1", n, k))
    emb = t["token_embd.weight"]
    raw = torch.from_numpy(np.ascontiguousarray(emb.data).copy())
    stored.append((ops.pack_linear(raw, "q8_0", raw.shape[0], int(emb.shape[0])), "q8_0", raw.shape[0], int(emb.shape[0])))
    shapes = [(p[2], p[3]) for p in stored]
    gen = torch.Generator().manual_seed(0)
    dense = [(torch.randn(n, k, generator=gen) * 0.02).to(torch.bfloat16) for n, k in shapes]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in dense]
    mine = [ops.pack_linear(w, "bf16", w.shape[0], w.shape[1]) for w in dense]
    bf16_bytes = sum(w.numel() * 2 for w in dense)
    stored_bytes = sum(p[0].numel() for p in stored)
    info = machine_info()
    print(f"{info['cpu']}, {info['cores']} cores, torch {info['torch']} ({info['torch_threads']} threads), {info['date']}")
    print(f"weights per step: bf16 {bf16_bytes / 1e6:.0f} MB, as stored (Q4_1 + Q8_0) {stored_bytes / 1e6:.0f} MB")
    print("| rows | eager F.linear bf16 | oneDNN packed bf16 | tripod kernel bf16 | tripod kernel, stored Q4_1/Q8_0 (fp32 act.) |")
    print("|---|---|---|---|---|")
    for m in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(m, k, generator=gen).to(torch.bfloat16) for k in {s[1] for s in shapes}}
        xf = {k: v.float() for k, v in xs.items()}
        cells = [
            bench(lambda xs=xs: [F.linear(xs[w.shape[1]], w) for w in dense], args.reps),
            bench(lambda xs=xs: [torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "") for w, p in zip(dense, onednn, strict=True)], args.reps),
            bench(lambda xs=xs: [ops.linear_packed(xs[k], p, "bf16", n, k) for (n, k), p in zip(shapes, mine, strict=True)], args.reps),
            bench(lambda xf=xf: [ops.linear_packed(xf[k], p, f, n, k) for p, f, n, k in stored], args.reps),
        ]
        gbs = [bf16_bytes / c / 1e6 for c in cells[:3]] + [stored_bytes / cells[3] / 1e6]
        print(f"| {m} | " + " | ".join(f"{c:.1f} ms ({g:.0f} GB/s)" for c, g in zip(cells, gbs, strict=True)) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
