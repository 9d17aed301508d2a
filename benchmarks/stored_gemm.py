"""The embedded model's per-layer linears (QKV 960x576, O 576x576, gate+up 3072x576, down
576x1536), timed on tripod's kernel for bf16 weights and for stored Q4_1 / Q4_0 / Q8_0 blocks
(random codes, the GGUF's layout), at several batch sizes: ms per decode step (30 layers, LM head
left out) and GFLOP/s. Best of ``--reps``.

A stored form runs with float32 activations (``q4_1``) or bf16 activations (``q4_1@bf16``: exact
bf16 x code products, vdpbf16ps where the level has it). ``--layers 30`` gives every layer its own
weights (the real working set: ~66 MB of Q4_1, more than the L3 holds); the default, 1, reuses one
layer's weights 30 times (they stay cached: the kernels' compute rate, not the memory's).

    PYTHONPATH=. .venv/bin/python benchmarks/stored_gemm.py --rows 1,4,16,64,256 [--forms bf16,q4_1,q4_1@bf16] [--layers 30]
"""

from __future__ import annotations

import argparse
import platform
import time

import numpy as np
import torch

from tripod import kernels

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LAYERS = 30


def _blocks(fmt: str, n: int, k: int, rng: np.random.Generator) -> torch.Tensor:
    """Random GGUF blocks: Q4_1 (fp16 d, m, 16 bytes of codes), Q4_0 (fp16 d, 16 bytes) or Q8_0
    (fp16 d, 32 int8 codes)."""
    per, scales = {"q4_1": (20, 2), "q4_0": (18, 1), "q8_0": (34, 1)}[fmt]
    raw = rng.integers(0, 256, size=(n, k // 32, per), dtype=np.uint8)
    d = rng.uniform(0.001, 0.05, size=(n, k // 32, scales)).astype(np.float16)
    raw[..., : 2 * scales] = d.view(np.uint8).reshape(n, k // 32, 2 * scales)
    return torch.from_numpy(raw.reshape(n, -1).copy())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,4,16,64,256")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--level", default=None)
    ap.add_argument("--forms", default="bf16,q4_1,q4_1@bf16")
    ap.add_argument("--layers", type=int, default=1, help="distinct layers of weights (30: all cold)")
    a = ap.parse_args()
    assert kernels.load(a.level, wait=True), kernels.unavailable_reason()
    ops = kernels.ops(a.level)
    rng = np.random.default_rng(0)
    forms: dict[str, list[list[tuple[torch.Tensor, int, int]]]] = {}
    for name in a.forms.split(","):
        fmt = name.split("@")[0]
        layers = []
        for _ in range(a.layers):
            if fmt == "bf16":
                layers.append([(ops.pack_linear(torch.randn(n, k).to(torch.bfloat16), "bf16", n, k), n, k) for n, k in SHAPES])
            else:
                layers.append([(ops.pack_linear(_blocks(fmt, n, k, rng), fmt, n, k), n, k) for n, k in SHAPES])
        forms[name] = layers
    print(f"# {platform.processor() or platform.machine()}, torch threads {torch.get_num_threads()}, "
          f"level {a.level or kernels.best_level()}, {a.layers} distinct layer(s) of weights")
    print("| rows | form | ms / step (30 layers) | GFLOP/s |")
    print("|---|---|---|---|")
    for m in [int(r) for r in a.rows.split(",")]:
        for name, layers in forms.items():
            fmt = name.split("@")[0]
            bf = fmt == "bf16" or name.endswith("@bf16")
            x = torch.randn(m, 576).to(torch.bfloat16 if bf else torch.float32)
            xd = torch.randn(m, 1536).to(x.dtype)
            best = float("inf")
            for _ in range(a.reps):
                t0 = time.perf_counter()
                for i in range(LAYERS):
                    for w, n, k in layers[i % len(layers)]:
                        ops.linear_packed(xd if k == 1536 else x, w, fmt, n, k)
                best = min(best, time.perf_counter() - t0)
            flops = 2 * m * sum(n * k for n, k in SHAPES) * LAYERS
            print(f"| {m} | {name} | {best * 1e3:.2f} | {flops / best / 1e9:.1f} |")


if __name__ == "__main__":
    main()
