"""The hybrid benchmark's decode TPOT (``hybrid_context.py``'s model and ``_decode_once``) of two
source trees, alternating: one process per tree and run (their kernels share an op namespace), each
prefilling and decoding every context once; prints one JSON line per (tree, run, context).

    git archive 09f0580 | tar -x -C /tmp/old
    PYTHONPATH=$PWD python benchmarks/hybrid_decode_ab.py --tree old=/tmp/old --tree new=$PWD \\
        --contexts 1024,32768 --reps 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run_one(model: str, contexts: list[int], decode: int, tag: str) -> None:
    """In the tree on sys.path: one engine, each context prefilled and decoded once."""
    import hybrid_context as hc

    import tripod
    from tripod import Engine

    top = max(contexts) + decode + 16
    eng = Engine(model=model, dtype="float32", max_running=1, kv_cache_tokens=top, max_model_len=top,
                 chunk_size=512, enable_prefix_cache=False, num_threads=1, kernels="optimized")
    try:
        for ctx in contexts:
            r = hc._decode_once(eng, ctx, decode, seed=ctx)
            print(json.dumps({"tree": tag, "tripod": tripod.__file__, "context": ctx, **r}), flush=True)
    finally:
        eng.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", action="append", required=True, help="NAME=PATH of a source tree (repeat)")
    ap.add_argument("--contexts", default="1024,32768")
    ap.add_argument("--decode", type=int, default=24)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--model", default="/tmp/hybrid-decode-ab", help="checkpoint folder (built if missing)")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one tree in this process
    args = ap.parse_args(argv)
    contexts = [int(c) for c in args.contexts.split(",")]
    if args.one:
        run_one(args.model, contexts, args.decode, args.one)
        return 0
    model = Path(args.model)
    if not (model / "config.json").is_file():
        import hybrid_context as hc

        hc.build_checkpoint(hc.model_configs(128, 8, 4, 2, 32, 49152, max(contexts) + 64)["hybrid"], model)
    trees = [t.split("=", 1) for t in args.tree]
    for _ in range(args.reps):
        for name, path in trees:
            root = Path(path).resolve()
            env = {**os.environ, "PYTHONPATH": f"{root}:{root / 'benchmarks'}"}
            subprocess.run([sys.executable, str(HERE / "hybrid_decode_ab.py"), "--tree", f"{name}={root}",
                            "--one", name, "--model", str(model), "--contexts", args.contexts,
                            "--decode", str(args.decode)], cwd=root, env=env, check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
