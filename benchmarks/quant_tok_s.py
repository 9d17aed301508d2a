r"""Decode tok/s of one model in three forms: the embedded Q4_1 GGUF, its weights as a bf16 HF folder,
and those weights quantized to a compressed-tensors W4A16 folder (int4, group 128, symmetric, RTN),
all through tripod's engine on the host's best kernels (``--kernels optimized``), bf16 activations.

The folders are made from the GGUF itself: transformers reads it (dequantizing Q4_1 / Q8_0 to
float32); the bf16 folder is those weights rounded to bf16; the W4A16 folder quantizes the float32
weights with the test-side packer (``tests/support/int_quant.py``'s ``save_quantized``, compressed-
tensors ``pack-quantized``, bf16 scales; the head stays unquantized, as compressed-tensors' ``ignore:
[lm_head]`` leaves it). Forms run interleaved (A, B, C, A, B, C, ...) and the medians are reported:

- prefill: the wall time of a request with ``max_tokens=1`` (C prompts at once);
- decode tok/s: ``C * (N - 1) / (t_N - t_1)``: the N-token run less the 1-token run, so prefill drops out;
- ``weight_bytes``: every distinct weight tensor the engine holds (``/debug/engine``'s figure).

    PYTHONPATH=. .venv/bin/python benchmarks/quant_tok_s.py --ab --repeats 5 --prompt-len 32 \
        --new-tokens 24 --threads 1    # benchmarks/results/quant_tok_s.md (~4 min on 2 shared cores)
    PYTHONPATH=. .venv/bin/python benchmarks/quant_tok_s.py --repeats 1 --new-tokens 4 --concurrency 1,2 \
        --layers 2 --out /tmp/q    # a smoke run (~1 min; the HF forms with 2 layers)
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))  # tests.support (the packer) from a checkout

from tests.support.int_quant import save_quantized  # noqa: E402
from tripod import Engine, SamplingParams  # noqa: E402
from tripod.engine.executor.group import resident_weight_bytes  # noqa: E402
from tripod.layers import linear as linear_mod  # noqa: E402
from tripod.loader.embedded import embedded_model_path  # noqa: E402

FORMS = ("W4A16 (compressed-tensors, group 128)", "Q4_1 GGUF", "bf16")
BEFORE = "W4A16, Q4_K form (before narrowing)"  # --ab: the int4 blocks as 24 bytes per 32 inputs


def cpu_info() -> dict[str, Any]:
    name, flags = platform.processor(), set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name") and name == platform.processor():
            name = line.split(":", 1)[1].strip()
        if line.startswith("flags") and not flags:
            flags = set(line.split(":", 1)[1].split())
    isa = sorted(f for f in flags if f.startswith(("avx512", "amx")) or f in ("avx2", "fma", "avx_vnni"))
    return {"cpu": name, "isa_flags": isa, "threads": torch.get_num_threads()}


def make_folders(work: Path, layers: int | None) -> dict[str, str]:
    """The GGUF's path and the bf16 / W4A16 folders made from it (``layers``: keep only the first
    few decoder layers, for a smoke run; the GGUF then has all of them)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = embedded_model_path()
    bf16, w4 = work / "bf16", work / "w4a16-g128"
    made = {FORMS[0]: str(w4), FORMS[1]: str(gguf), FORMS[2]: str(bf16)}
    if (w4 / "model.safetensors").is_file() and (bf16 / "model.safetensors").is_file():
        return made  # made by an earlier run
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    read = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # a plain model of the same config (transformers will not save one it read from a GGUF)
    cfg = read.config
    if hasattr(cfg, "quantization_config"):  # the GGUF's: these folders hold plain float weights
        del cfg.quantization_config
    model = type(read)(cfg).eval()
    model.load_state_dict(read.state_dict())
    del read
    if layers is not None:
        model.model.layers = model.model.layers[:layers]
        model.config.num_hidden_layers = layers
    save_quantized(model, w4, tok, "ct", bits=4, group=128, sym=True)
    model.to(torch.bfloat16).save_pretrained(str(bf16))
    tok.save_pretrained(str(bf16))
    return made


def timed(eng: Engine, prompts: list[list[int]], new: int) -> tuple[float, list[list[int]]]:
    eng.reset_prefix_cache()  # every run computes its prefill
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = eng.generate(prompts, params)
    return time.perf_counter() - t0, [list(o.token_ids) for o in outs]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--kernels", default="optimized")
    ap.add_argument("--threads", type=int, default=None,
                    help="threads per engine (default: torch's; 1 is steadier where other work shares the cores)")
    ap.add_argument("--ab", action="store_true",
                    help="also run the W4A16 folder with its int4 blocks kept in the Q4_K form (layers/linear.narrowed off)")
    ap.add_argument("--layers", type=int, default=None, help="keep the first few decoder layers in the HF forms (smoke runs)")
    ap.add_argument("--work", type=Path, default=Path.home() / ".cache" / "tripod" / "quant_tok_s",
                    help="where the bf16 / W4A16 folders are made (reused when present)")
    ap.add_argument("--out", type=Path, default=ROOT / "results")
    args = ap.parse_args()
    conc = [int(c) for c in args.concurrency.split(",")]
    work = args.work if args.layers is None else args.work / f"layers{args.layers}"
    folders = make_folders(work, args.layers)
    if args.ab:
        folders = {FORMS[0]: folders[FORMS[0]], BEFORE: folders[FORMS[0]], **folders}
    engines: dict[str, Engine] = {}
    for form, path in folders.items():
        if form == BEFORE:  # the kernels pack at build: keep the Q4_K form for this engine only
            keep, linear_mod.narrowed_kind = linear_mod.narrowed_kind, lambda stored: stored.kind
        # the quantized forms as `--weights auto` runs them (stored codes, bf16 activations under
        # `--dtype auto`); the bf16 folder as bf16 weights and activations
        engines[form] = Engine(model=path, dtype="bfloat16" if form == FORMS[2] else "auto", kernels=args.kernels,
                               max_running=max(conc), **({"num_threads": args.threads} if args.threads else {}),
                               kv_cache_tokens=max(conc) * (args.prompt_len + args.new_tokens) + 256)
        if form == BEFORE:
            linear_mod.narrowed_kind = keep
    g = torch.Generator().manual_seed(0)
    prompts = {c: [torch.randint(100, 40000, (args.prompt_len,), generator=g).tolist() for _ in range(c)] for c in conc}
    samples: dict[tuple[str, int], dict[str, list[float]]] = {}
    tokens: dict[tuple[str, int], list[list[int]]] = {}
    for eng in engines.values():  # warm-up (kernel packing, first-call allocations)
        timed(eng, prompts[conc[0]][:1], 2)
    for r in range(args.repeats):
        for c in conc:
            for form, eng in engines.items():  # interleaved: each form once per round
                t1, _ = timed(eng, prompts[c], 1)
                tn, toks = timed(eng, prompts[c], args.new_tokens)
                s = samples.setdefault((form, c), {"prefill_s": [], "decode_tok_s": []})
                s["prefill_s"].append(t1)
                # (a run so short that the difference is lost in the noise counts as no figure)
                s["decode_tok_s"].append(c * (args.new_tokens - 1) / (tn - t1) if tn > t1 else float("nan"))
                tokens[(form, c)] = toks
                print(f"round {r + 1}/{args.repeats} C={c} {form}: {s['decode_tok_s'][-1]:.1f} tok/s", file=sys.stderr, flush=True)
    info = cpu_info()
    info["threads"] = args.threads or info["threads"]
    rows = []
    for form, eng in engines.items():
        net = eng.loaded.model
        for c in conc:
            s = samples[(form, c)]
            rows.append({
                "form": form, "concurrency": c, "decode_tok_s": round(statistics.median(s["decode_tok_s"]), 1),
                "prefill_s": round(statistics.median(s["prefill_s"]), 4), "decode_tok_s_runs": [round(x, 1) for x in s["decode_tok_s"]],
                "weight_bytes": resident_weight_bytes(net), "compute": eng.runner.describe(),
                "weights": eng.config.weights, "dtype": str(eng.dtype).removeprefix("torch."),
                "quantization": eng.loaded.quantization, "path": folders[form],
            })
    for r in rows:  # paired: W4A16's run over this form's run of the same round, the median of those
        mine, theirs = samples[(FORMS[0], r["concurrency"])]["decode_tok_s"], samples[(r["form"], r["concurrency"])]["decode_tok_s"]
        r["w4a16_over_this"] = round(statistics.median(a / b for a, b in zip(mine, theirs, strict=True)), 3)
    cmd = " ".join(["python", *[str(a) for a in sys.argv]])
    result = {"date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"), "command": cmd,
              "machine": {**info, "note": "shared machine"}, "prompt_len": args.prompt_len,
              "new_tokens": args.new_tokens, "repeats": args.repeats, "kernels": args.kernels, "rows": rows,
              "same_greedy_tokens_w4a16_narrowed_vs_q4_k_form": ({c: tokens[(FORMS[0], c)] == tokens[(BEFORE, c)] for c in conc}
                                                                  if args.ab else None)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "quant_tok_s.json").write_text(json.dumps(result, indent=2))
    (args.out / "quant_tok_s.md").write_text(render(result, conc))
    print(render(result, conc))
    return 0


def render(res: dict[str, Any], conc: list[int]) -> str:
    m = res["machine"]
    mib = 1 << 20
    lines = [
        "# Decode tok/s: W4A16 (group 128) vs the Q4_1 GGUF vs bf16, made from the same weights"
        + ("" if any(f.startswith("amx") for f in m["isa_flags"]) else " (no AMX on this CPU)"),
        "",
        f"{res['date']}, `{res['command']}` (`benchmarks/quant_tok_s.py`).",
        f"CPU: {m['cpu']} ({', '.join(m['isa_flags'])}), {m['threads']} threads, **shared machine** "
        "(other sessions use the same 2 cores: compare within one run).",
        f"tripod `--kernels {res['kernels']}`, quantized forms with `--weights auto` (= stored codes, bf16 activations), bf16 with `--dtype bfloat16`, {res['prompt_len']}-token "
        f"random prompts, {res['new_tokens']} new tokens (greedy, ignore_eos); forms interleaved, medians of "
        f"{res['repeats']} rounds; the ratios are the medians of each round's ratio (paired). decode tok/s = C·(N−1) / (t(N tokens) − t(1 token)); prefill = t(1 token).",
        "",
        "| form | weight_bytes (MiB) | " + " | ".join(f"C={c} decode tok/s | C={c} prefill (s)" for c in conc)
        + " | " + " | ".join(f"W4A16 ÷ this, C={c}" for c in conc) + " |",
        "|---|---|" + "---|---|" * len(conc) + "---|" * len(conc),
    ]
    for form in dict.fromkeys([FORMS[0], *(r["form"] for r in res["rows"])]):
        rs = {r["concurrency"]: r for r in res["rows"] if r["form"] == form}
        cells = " | ".join(f"{rs[c]['decode_tok_s']} | {rs[c]['prefill_s']:.3f}" for c in conc)
        ratios = " | ".join(f"{rs[c]['w4a16_over_this']:.2f}" for c in conc)
        lines.append(f"| {form} | {rs[conc[0]]['weight_bytes'] / mib:.1f} | {cells} | {ratios} |")
    if res["same_greedy_tokens_w4a16_narrowed_vs_q4_k_form"] is not None:
        lines += ["", "W4A16 narrowed vs its Q4_K form, the same greedy tokens (C: yes/no): " + ", ".join(
            f"{c}: {'yes' if v else 'no'}" for c, v in res["same_greedy_tokens_w4a16_narrowed_vs_q4_k_form"].items())]
    lines += ["", "Runs (decode tok/s, in order): " + "; ".join(
        f"{r['form']} C={r['concurrency']}: {r['decode_tok_s_runs']}" for r in res["rows"]), ""]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
