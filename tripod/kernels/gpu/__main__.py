"""``python -m tripod.kernels.gpu compile --target sm_90``: compile every Triton kernel for the
architecture without a GPU and print its registers, spills and shared memory; exits non-zero when
one fails to compile or needs more shared memory than a block may have."""

from __future__ import annotations

import argparse
import json
import os
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tripod.kernels.gpu")
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("compile", help="compile every kernel for a GPU architecture (no GPU needed)")
    c.add_argument("--target", default="sm_90", help="sm_80, sm_89, sm_90 (H100/H200), sm_100")
    c.add_argument("--only", default=None, help="compile only the variants whose name contains this")
    c.add_argument("--json", action="store_true", help="print the results as JSON")
    c.add_argument("--max-shared", type=int, default=None,
                   help="shared memory a block may use, in bytes (default: the architecture's opt-in maximum)")
    args = ap.parse_args(argv)
    if not args.target.startswith("sm_") or not args.target[3:].rstrip("a").isdigit():
        ap.error(f"--target must look like sm_90 (got {args.target!r})")
    os.environ.pop("TRITON_INTERPRET", None)  # (before triton is imported: the interpreter compiles nothing)
    from tripod.kernels.gpu.compile import compile_all

    arch = int(args.target[3:].rstrip("a"))
    results = compile_all(arch, args.only, args.max_shared)
    if args.json:
        print(json.dumps([r.__dict__ for r in results], indent=2))
    else:
        print(f"{'kernel':52s} {'regs':>5s} {'spill':>6s} {'shared':>8s}  result")
        for r in results:
            spill = "-" if r.spill_stores is None else str(r.spill_stores)
            print(f"{r.name:52s} {r.registers if r.registers is not None else '-':>5} {spill:>6s} "
                  f"{r.shared if r.shared is not None else '-':>8}  {'ok' if r.ok else 'FAILED: ' + (r.error or '')}")
    failed = [r for r in results if not r.ok]
    if not results:
        print("no kernel matched", file=sys.stderr)
        return 2
    if failed:
        print(f"{len(failed)} of {len(results)} kernels failed for {args.target}", file=sys.stderr)
        return 1
    print(f"all {len(results)} kernels compiled for {args.target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
