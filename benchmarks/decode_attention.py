"""One decode row's paged attention (``paged_attention``, one query over a request's cached keys)
at several context lengths, the kernels of two source revisions alternating in one process.

``cpu_kernels.cpp`` of ``--old`` (a git revision) and of the working tree are each compiled on their
own, with the flags of ``--level``, under their own op namespace (``tripod_ab_old`` / ``tripod_ab_new``),
so both load side by side; every case checks that the two give the same bits. Per case: median
seconds per call over ``--repeats`` rounds of ``old, new`` (several calls per round), the KV bytes the
call reads and the rate that makes, and old / new.

    PYTHONPATH=$PWD python benchmarks/decode_attention.py --old HEAD~1 --threads 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "tripod" / "kernels" / "csrc"
# (dtype, query heads, KV heads, head_dim): the hybrid benchmark's float32 layer, a Llama-8B-like
# bf16 layer (the default serve dtype), and the hybrid's shape in bf16.
SHAPES = [(torch.float32, 4, 2, 32), (torch.bfloat16, 32, 8, 128), (torch.bfloat16, 4, 2, 32)]


def compile_kernels(source: str, namespace: str, level: str, out: Path) -> None:
    """``source`` (cpu_kernels.cpp's text) compiled alone into ``out`` under ``namespace``."""
    from tripod.kernels.build import _ISA_FLAGS, BASE_FLAGS

    folder = out.parent / f"src-{namespace}"
    folder.mkdir(parents=True, exist_ok=True)
    for header in ("simd.h", "amx.h"):
        (folder / header).write_text((CSRC / header).read_text())
    src = folder / "cpu_kernels.cpp"
    src.write_text(source)
    tdir = Path(torch.__file__).resolve().parent
    inc, lib = tdir / "include", tdir / "lib"
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    cmd = [os.environ.get("CXX", "c++"), *BASE_FLAGS, *_ISA_FLAGS[level], f"-DTRIPOD_OPS_NS={namespace}",
           f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-I{inc}", f"-I{inc / 'torch' / 'csrc' / 'api' / 'include'}",
           str(src), "-o", str(out), f"-L{lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib}"]
    subprocess.run(cmd, check=True)


def case(dtype: torch.dtype, heads: int, kvh: int, d: int, ctx: int, scattered: bool) -> tuple[torch.Tensor, ...]:
    """A pool of ``ctx`` keys, one request's table over them (ascending slots, as a fresh pool
    hands out, or a random permutation) and one decode query attending all of them."""
    g = torch.Generator().manual_seed(ctx)
    kv = torch.randn(ctx + 16, 2, kvh, d, generator=g).to(dtype)
    slots = torch.randperm(ctx + 16, generator=g) if scattered else torch.arange(ctx + 16)
    q = torch.randn(1, heads, d, generator=g).to(dtype)
    return q, kv, slots.to(torch.int32).view(1, -1), torch.zeros(1, dtype=torch.int32), torch.tensor([ctx], dtype=torch.int32)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", default="HEAD", help="git revision of the old cpu_kernels.cpp")
    ap.add_argument("--level", default="avx512_bf16", help="ISA level whose flags both builds use")
    ap.add_argument("--contexts", default="1024,8192,32768")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--scattered", action="store_true", help="slots in random order (a long-running pool)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    old_src = subprocess.run(["git", "show", f"{args.old}:tripod/kernels/csrc/cpu_kernels.cpp"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout
    libs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, src in (("old", old_src), ("new", (CSRC / "cpu_kernels.cpp").read_text())):
            ns = f"tripod_ab_{name}"
            so = Path(tmp) / f"{ns}.so"
            compile_kernels(src, ns, args.level, so)
            torch.ops.load_library(str(so))
            libs[name] = getattr(torch.ops, ns)
    print("| dtype | heads / KV heads × dim | context | KV MiB | old ms | new ms | old GB/s | new GB/s | old / new | bits |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for dtype, heads, kvh, d in SHAPES:
        for ctx in (int(c) for c in args.contexts.split(",")):
            inputs = case(dtype, heads, kvh, d, ctx, args.scattered)
            outs = {n: ops.paged_attention(*inputs, d**-0.5) for n, ops in libs.items()}
            same = torch.equal(outs["old"], outs["new"])
            calls = max(3, int(2e6 // (ctx * kvh * d)))
            times: dict[str, list[float]] = {n: [] for n in libs}
            for _ in range(args.repeats):
                for n, ops in libs.items():
                    t = time.perf_counter()
                    for _ in range(calls):
                        ops.paged_attention(*inputs, d**-0.5)
                    times[n].append((time.perf_counter() - t) / calls)
            med = {n: statistics.median(v) for n, v in times.items()}
            nbytes = ctx * 2 * kvh * d * inputs[1].element_size()
            print(f"| {str(dtype).removeprefix('torch.')} | {heads} / {kvh} × {d} | {ctx} | {nbytes / 2**20:.1f} | "
                  f"{med['old'] * 1e3:.3f} | {med['new'] * 1e3:.3f} | {nbytes / med['old'] / 1e9:.1f} | "
                  f"{nbytes / med['new'] / 1e9:.1f} | {med['old'] / med['new']:.2f}× | {'same' if same else 'DIFFER'} |",
                  flush=True)
            if not same:
                print("the two revisions give different bits", file=sys.stderr)
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
