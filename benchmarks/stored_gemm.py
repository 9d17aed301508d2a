"""The embedded model's per-layer linears (QKV 960x576, O 576x576, gate+up 3072x576, down
576x1536), timed on tripod's kernel for bf16 weights and for stored Q4_1 / Q4_0 blocks (random
codes, the GGUF's layout), at several batch sizes: ms per decode step (x 30 layers, LM head left out)
and GFLOP/s. Best of ``--reps``.

    PYTHONPATH=. .venv/bin/python benchmarks/stored_gemm.py --rows 1,4,16,64,256 [--forms bf16,q4_1,q4_0]
"""

from __future__ import annotations

import argparse
import platform
import time

import numpy as np
import torch

from tripod import kernels

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def _blocks(fmt: str, n: int, k: int, rng: np.random.Generator) -> torch.Tensor:
    """Random GGUF blocks: Q4_1 (fp16 d, m, 16 bytes of codes) or Q4_0 (fp16 d, 16 bytes)."""
    per, scales = (20, 2) if fmt == "q4_1" else (18, 1)
    raw = rng.integers(0, 256, size=(n, k // 32, per), dtype=np.uint8)
    d = rng.uniform(0.001, 0.05, size=(n, k // 32, scales)).astype(np.float16)
    raw[..., : 2 * scales] = d.view(np.uint8).reshape(n, k // 32, 2 * scales)
    return torch.from_numpy(raw.reshape(n, -1).copy())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,4,16,64,256")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--level", default=None)
    ap.add_argument("--forms", default="bf16,q4_1,q4_0")
    a = ap.parse_args()
    assert kernels.load(a.level, wait=True), kernels.unavailable_reason()
    ops = kernels.ops(a.level)
    rng = np.random.default_rng(0)
    forms = {}
    for name in a.forms.split(","):
        if name == "bf16":
            forms[name] = [(ops.pack_linear(torch.randn(n, k).to(torch.bfloat16), "bf16", n, k), n, k) for n, k in SHAPES]
        else:
            forms[name] = [(ops.pack_linear(_blocks(name, n, k, rng), name, n, k), n, k) for n, k in SHAPES]
    print(f"# {platform.processor() or platform.machine()}, torch threads {torch.get_num_threads()}")
    print("| rows | form | ms / step (30 layers) | GFLOP/s |")
    print("|---|---|---|---|")
    for m in [int(r) for r in a.rows.split(",")]:
        for name, ws in forms.items():
            x = torch.randn(m, 576).to(torch.bfloat16 if name == "bf16" else torch.float32)
            xd = torch.randn(m, 1536).to(x.dtype)
            best = float("inf")
            for _ in range(a.reps):
                t0 = time.perf_counter()
                for w, n, k in ws:
                    ops.linear_packed(xd if k == 1536 else x, w, name, n, k)
                best = min(best, time.perf_counter() - t0)
            flops = 2 * m * sum(n * k for n, k in SHAPES) * 30
            print(f"| {m} | {name} | {best * 30e3:.2f} | {flops / (best * 30) / 1e9:.1f} |")


if __name__ == "__main__":
    main()
