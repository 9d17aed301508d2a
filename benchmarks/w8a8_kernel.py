r"""W8A8 INT8 linears: tripod's CPU kernel (``int8_linear``, ``kernels/csrc/int8.cpp``) vs the
``torch._int_mm`` path it replaces, interleaved in one run (old, new, old, new, ...; medians).

- ``linear``: the whole ``W8A8Linear`` call (per-token quantization in torch, the product, the
  float64 epilogue) with float32 activations, ``ops`` off (old: ``_int_mm``) and on (new: the
  kernel's ``int8_linear_scaled``, product and epilogue, up to ``KERNEL_MAX_ROWS`` rows, ``_int_mm``
  above, as the engine runs it);
- ``product``: the int8 x int8 -> int32 product alone, ``torch._int_mm`` vs ``int8_linear`` at every
  row count (why the kernel stops at ``KERNEL_MAX_ROWS``);
- ``--e2e``: decode tok/s (C = 1) of the embedded SmolLM2 as a compressed-tensors W8A8 INT8 folder
  (dynamic per-token activations, made with the test-side packer) with the kernel on and off, and of
  its bf16 folder, on the host's best kernels; greedy tokens compared between kernel on and off.

    PYTHONPATH=. .venv/bin/python benchmarks/w8a8_kernel.py --e2e --out benchmarks/results/w8a8_kernel.md
"""

from __future__ import annotations

import argparse
import datetime
import functools
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))  # tests.support (the packer) from a checkout

from tripod import kernels  # noqa: E402
from tripod.layers import w8a8  # noqa: E402

SHAPES = ((1536, 576), (576, 1536), (4096, 4096))  # (N, K): SmolLM2-135M's up and down widths, a 7B-size square
ROWS = (1, 16, 64, 256)


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def _ab(fns: tuple[Callable[[], object], Callable[[], object]], repeats: int) -> tuple[float, float]:
    """Median seconds of each of two callables, run alternately."""
    times: tuple[list[float], list[float]] = ([], [])
    for f in fns:
        f()  # warm-up
    for _ in range(repeats):
        for f, t in zip(fns, times, strict=True):
            t0 = time.perf_counter()
            f()
            t.append(time.perf_counter() - t0)
    return statistics.median(times[0]), statistics.median(times[1])


def micro(ops: object, repeats: int) -> list[str]:
    g = torch.Generator().manual_seed(0)
    lines = ["| N x K | rows | linear old ms (_int_mm) | linear new ms | new / old speed | product _int_mm ms | "
             "product int8_linear ms | same bits |", "|---|---|---|---|---|---|---|---|"]
    for n, k in SHAPES:
        codes = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
        scales = torch.rand(n, generator=g) / 100
        old = w8a8.W8A8Linear(codes, scales, "int8", None)
        new = w8a8.W8A8Linear(codes, scales, "int8", None, ops=ops)
        for m in ROWS:
            x = torch.randn(m, k, generator=g)
            q, _ = w8a8.quantize_per_token(x, "int8")
            same = torch.equal(old(x), new(x)) and torch.equal(torch._int_mm(q, codes.t()), ops.int8_linear(q, codes, new.wsum))
            lo, ln = _ab((functools.partial(old, x), functools.partial(new, x)), repeats)
            po, pn = _ab((functools.partial(torch._int_mm, q, codes.t()),
                          functools.partial(ops.int8_linear, q, codes, new.wsum)), repeats)
            lines.append(f"| {n} x {k} | {m} | {lo * 1e3:.3f} | {ln * 1e3:.3f} | {lo / ln:.2f}x | {po * 1e3:.3f} | "
                         f"{pn * 1e3:.3f} | {'yes' if same else 'NO'} |")
            print(lines[-1], file=sys.stderr, flush=True)
    return lines


def e2e(repeats: int, new_tokens: int, work: Path) -> list[str]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.support.int_quant import save_quantized
    from tripod import Engine, SamplingParams
    from tripod.loader.embedded import embedded_model_path

    gguf = embedded_model_path()
    folder, bf16 = work / "w8a8-int8", work / "bf16"
    if not (folder / "model.safetensors").is_file() or not (bf16 / "model.safetensors").is_file():
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        read = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        cfg = read.config
        if hasattr(cfg, "quantization_config"):
            del cfg.quantization_config
        model = type(read)(cfg).eval()
        model.load_state_dict(read.state_dict())
        save_quantized(model, folder, tok, "w8a8-int8")
        model.to(torch.bfloat16).save_pretrained(str(bf16))
        tok.save_pretrained(str(bf16))
    engs = {"W8A8 INT8": Engine(model=str(folder), dtype="auto", num_threads=1, kv_cache_tokens=512),
            "bf16": Engine(model=str(bf16), dtype="bfloat16", num_threads=1, kv_cache_tokens=512)}
    prompt = [torch.randint(100, 40000, (32,), generator=torch.Generator().manual_seed(0)).tolist()]
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def rate(eng: Engine) -> tuple[float, list[int]]:
        eng.reset_prefix_cache()
        t0 = time.perf_counter()
        eng.generate(prompt, one)
        t1 = time.perf_counter()
        eng.reset_prefix_cache()
        out = eng.generate(prompt, params)
        tn = time.perf_counter() - t1
        return (new_tokens - 1) / (tn - (t1 - t0)), list(out[0].token_ids)

    runs: dict[str, list[float]] = {"W8A8 INT8, int8_linear (new)": [], "W8A8 INT8, torch._int_mm (old)": [], "bf16": []}
    toks: dict[str, list[int]] = {}
    keep = w8a8.KERNEL_MAX_ROWS
    for eng in engs.values():
        rate(eng)  # warm-up
    for _ in range(repeats):
        for form in runs:
            w8a8.KERNEL_MAX_ROWS = 0 if "old" in form else keep  # old: every product on torch._int_mm
            r, toks[form] = rate(engs["bf16" if form == "bf16" else "W8A8 INT8"])
            runs[form].append(r)
            print(f"{form}: {r:.1f} tok/s", file=sys.stderr, flush=True)
    w8a8.KERNEL_MAX_ROWS = keep
    lines = [f"Decode tok/s, C = 1, 32-token prompt, {new_tokens} new tokens, 1 thread, medians of {repeats} interleaved "
             f"rounds; compute: {engs['W8A8 INT8'].runner.describe()}.", "",
             "| form | decode tok/s | runs |", "|---|---|---|"]
    for form, rs in runs.items():
        lines.append(f"| {form} | {statistics.median(rs):.1f} | {', '.join(f'{r:.1f}' for r in rs)} |")
    same = toks["W8A8 INT8, int8_linear (new)"] == toks["W8A8 INT8, torch._int_mm (old)"]
    paired = [n / o for n, o in zip(runs["W8A8 INT8, int8_linear (new)"], runs["W8A8 INT8, torch._int_mm (old)"], strict=True)]
    lines += ["", f"Paired (the same round), new over old: median {statistics.median(paired):.2f}x "
              f"(runs {', '.join(f'{r:.2f}' for r in paired)})."]
    lines += ["", f"Greedy tokens, W8A8 with int8_linear vs with torch._int_mm: {'identical' if same else 'DIFFERENT'}."]
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1, help="torch threads for the micro-benchmark (1: steadier on shared cores)")
    ap.add_argument("--e2e", action="store_true", help="also decode tok/s of the embedded SmolLM2 as W8A8 vs bf16")
    ap.add_argument("--e2e-repeats", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--work", type=Path, default=Path.home() / ".cache" / "tripod" / "w8a8_kernel")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not kernels.load(wait=True):
        print(f"tripod's CPU kernels are unavailable: {kernels.unavailable_reason()}", file=sys.stderr)
        return 1
    ops = kernels.ops()
    head = [
        "# W8A8 INT8: tripod's int8_linear vs torch._int_mm",
        "",
        f"`python {' '.join(sys.argv)}` on {_cpu()} (AVX-512 + VNNI, no AMX), shared machine (2 cores shared with "
        f"other work), torch {torch.__version__}, {args.threads} thread(s), kernels level {kernels.best_level()} "
        f"(int8_linear path: {ops.int8_path()}), {datetime.datetime.now(datetime.UTC).strftime('%Y-%m-%d %H:%M UTC')}.",
        "",
        f"Per call, medians of {args.repeats} interleaved repeats. `linear`: the whole W8A8Linear (float32 activations "
        f"quantized per token, product, float64 epilogue) as the engine runs it — new = int8_linear_scaled (product and "
        f"epilogue in one call) up to {w8a8.KERNEL_MAX_ROWS} rows, torch._int_mm and torch's epilogue above (so rows > "
        f"{w8a8.KERNEL_MAX_ROWS} time the same path twice: their ratio is this host's noise). "
        "`product`: the int8 x int8 -> int32 product alone.",
        "",
    ]
    lines = head + micro(ops, args.repeats)
    if args.e2e:
        lines += ["", "## End to end", "", *e2e(args.e2e_repeats, args.new_tokens, args.work)]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
