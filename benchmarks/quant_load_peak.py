"""Peak resident memory while loading a W4A16 checkpoint with ``--weights stored`` (and, for
comparison, ``--weights dequantized``), against the bf16 size of its quantized projections: a tiny
random Llama (hidden 1024, intermediate 2048, 4 layers) quantized to compressed-tensors W4A16
(int4, group 32, symmetric) by the test packer. Each load runs in a fresh process
(``tests/support/load_peak.py``: ``VmHWM`` reset after the imports); the peak of loading a tiny
folder of the same format (hidden 64) is subtracted — what building any engine costs (the kernels,
the tokenizer, the KV pool). ``--old TREE``: also measure another tripod tree's loader (e.g. a
``git archive`` of an earlier commit), interleaved with this one.

    PYTHONPATH=. .venv/bin/python benchmarks/quant_load_peak.py [--old /tmp/old-tree] >> benchmarks/results/quant_memory.md

(a section appended to ``benchmarks/results/quant_memory.md``, beside ``benchmarks/quant_memory.py``'s table)
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import tempfile
from pathlib import Path

from tests.support.int_quant import save_quantized
from tests.support.load_peak import load_peak
from tests.support.tiny_models import build_hf
from tripod.loader.embedded import embedded_model_path

MiB = 2**20


def main() -> None:
    from transformers import AutoTokenizer

    ap = argparse.ArgumentParser()
    ap.add_argument("--old", type=Path, default=None, help="another tripod tree to compare")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    gguf = embedded_model_path()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    with tempfile.TemporaryDirectory() as d:
        big = build_hf("llama", seed=5, hidden_size=1024, intermediate_size=2048, num_hidden_layers=4)
        n = sum(p.numel() for name, p in big.named_parameters()
                if name.startswith("model.layers.") and name.endswith("proj.weight"))
        folder, _ = save_quantized(big, Path(d) / "big", tok, "ct", bits=4, group=32, sym=True)
        del big
        small, _ = save_quantized(build_hf("llama", seed=5), Path(d) / "small", tok, "ct", bits=4, group=32, sym=True)
        trees = {"this tree": None, **({"old tree": args.old} if args.old else {})}
        rows: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
        for _ in range(args.repeats):  # interleaved: every (tree, mode) once per round
            for tree, root in trees.items():
                for mode in ("stored", "dequantized"):
                    base = load_peak(small, "bfloat16", mode, root)
                    got = load_peak(folder, "bfloat16", mode, root)
                    extra = (got["peak"] - got["before"]) - (base["peak"] - base["before"])
                    kept = (got["after"] - got["before"]) - (base["after"] - base["before"])
                    rows.setdefault((tree, mode), []).append((extra, kept, got["weight_bytes"]))
    print("\n## Load peak: a quantized checkpoint vs its dense size\n")
    print(f"`benchmarks/quant_load_peak.py{' --old TREE' if args.old else ''}` on {cpu} (shared machine, "
          f"1 thread a load), {datetime.date.today()}; compressed-tensors W4A16 (int4, group 32, symmetric), "
          f"tiny random Llama hidden 1024, intermediate 2048, 4 layers: {n} quantized weights, "
          f"**{2 * n / MiB:.1f} MiB as bf16**, `--dtype bfloat16`. Peak: the load process's `VmHWM` above "
          "its size after the imports, less the same for a tiny folder of the format (the engine's own "
          f"cost); resident after: `VmRSS` the same way; medians of {args.repeats}.\n")
    print("| tree | --weights | load peak (MiB) | × bf16 projections | resident after (MiB) | weight_bytes (MiB) |")
    print("|---|---|---|---|---|---|")
    for (tree, mode), vals in rows.items():
        extra = statistics.median(v[0] for v in vals)
        kept = statistics.median(v[1] for v in vals)
        wb = statistics.median(v[2] for v in vals)
        print(f"| {tree} | {mode} | {extra / MiB:.1f} | {extra / (2 * n):.2f} | {kept / MiB:.1f} | {wb / MiB:.1f} |")


if __name__ == "__main__":
    main()
