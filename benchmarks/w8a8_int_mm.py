"""One W8A8 INT8 projection on the CPU: the integer product (``torch._int_mm``, what
``layers/w8a8.py`` runs) against the float64 emulation it replaced (the same bits), per call, at a
few row counts. Prints a Markdown table; ``--out`` writes it with the date, command and CPU."""

from __future__ import annotations

import argparse
import platform
import sys
import time
from datetime import date

import torch

from tripod.layers.w8a8 import W8A8Linear, quantize_per_token


def emulated(lin: W8A8Linear, x: torch.Tensor) -> torch.Tensor:
    """The former path: the codes' product summed in float64 (a float64 copy of the weight per call)."""
    q, sx = quantize_per_token(x, lin.kind)
    acc = q.to(torch.float64) @ lin.codes.to(torch.float64).t()
    return (acc * (sx.to(torch.float64) * lin.scales)).to(x.dtype)


def ms(fn: object, x: torch.Tensor, reps: int) -> float:
    fn(x)  # type: ignore[operator]
    t = time.perf_counter()
    for _ in range(reps):
        fn(x)  # type: ignore[operator]
    return (time.perf_counter() - t) / reps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 128])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out")
    a = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    lin = W8A8Linear(torch.randint(-128, 128, (a.n, a.k), dtype=torch.int8, generator=g),
                     torch.rand(a.n, generator=g) / 100, "int8", None)
    lines = ["| rows | float64 emulation ms | torch._int_mm ms | speed-up | same bits |", "|---|---|---|---|---|"]
    for m in a.rows:
        x = torch.randn(m, a.k, generator=g)
        same = torch.equal(lin(x), emulated(lin, x))
        e, i = ms(lambda t: emulated(lin, t), x, a.reps), ms(lin, x, a.reps)
        lines.append(f"| {m} | {e:.1f} | {i:.1f} | {e / i:.1f}x | {'yes' if same else 'NO'} |")
    table = "\n".join(lines)
    print(table)
    if a.out:
        cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
                   platform.processor())
        head = (f"# W8A8 INT8: integer product vs float64 emulation\n\n`python {' '.join(sys.argv)}` on {cpu}, "
                f"{torch.get_num_threads()} threads, torch {torch.__version__}, {date.today()}; one {a.n} x {a.k} "
                "int8 projection, float32 activations quantized per token, per call (mean of "
                f"{a.reps}).\n\n")
        with open(a.out, "w") as f:
            f.write(head + table + "\n")


if __name__ == "__main__":
    main()
