"""Resident weight bytes of quantized HF checkpoints: ``--weights stored`` (one packed copy of each
quantized projection) against ``--weights dequantized`` (bf16 parameters and the kernels' packed
bf16 copy), on a tiny random Llama (hidden 256, intermediate 512, 3 layers) quantized by the
test-side packers (``tests/support/int_quant.py``), with the greedy tokens of both (bf16
activations; the W8A8 folders only run as W8A8).

    PYTHONPATH=. .venv/bin/python benchmarks/quant_memory.py > benchmarks/results/quant_memory.md
"""

from __future__ import annotations

import datetime
import platform
import tempfile
from pathlib import Path

import torch

from tests.support.int_quant import save_quantized
from tests.support.tiny_models import build_hf
from tripod import Engine, SamplingParams
from tripod.engine.executor.group import resident_weight_bytes
from tripod.loader.embedded import embedded_model_path

CASES = {  # name -> (method, options)
    "W4A16 (compressed-tensors, int4 group 32, symmetric)": ("ct", dict(bits=4, group=32, sym=True)),
    "AWQ (int4 group 32, zero points)": ("awq", dict(bits=4, group=32)),
    "W8A16 (compressed-tensors, int8 per channel, symmetric)": ("ct", dict(bits=8, group=-1, sym=True)),
    "GPTQ int8 group 32 with zero points": ("gptq", dict(bits=8, group=32, sym=False)),
    "NVFP4A16": ("nvfp4", {}),
    "W8A8 INT8 (compressed-tensors int-quantized)": ("w8a8-int8", {}),
}


def main() -> None:
    from transformers import AutoTokenizer

    gguf = embedded_model_path()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    print("# Resident weight bytes: quantized checkpoints stored vs dequantized\n")
    print(f"`benchmarks/quant_memory.py` on {cpu}, {torch.get_num_threads()} threads, "
          f"{datetime.date.today()}; tiny random Llama (hidden 256, intermediate 512, 3 layers, vocab 256 "
          "embedding), `--dtype bfloat16`. `weight_bytes`: every distinct weight tensor the model "
          "holds (parameters, stored codes, the kernels' packed copies). Linear bytes = the quantized "
          "projections' share (a bf16 twin holds 2 bytes a weight).\n")
    print("| Checkpoint | dequantized: weight_bytes | stored: weight_bytes | stored linears: bytes a weight | same greedy tokens |")
    print("|---|---|---|---|---|")
    for name, (method, opts) in CASES.items():
        with tempfile.TemporaryDirectory() as d:
            model = build_hf("llama", seed=5, hidden_size=256, intermediate_size=512)
            folder, _ = save_quantized(model, Path(d), tok, method, **opts)
            runs = {}
            for mode in ("dequantized", "stored"):
                if method.startswith("w8a8") and mode == "dequantized":
                    continue
                eng = Engine(model=str(folder), dtype="bfloat16", kv_cache_tokens=512, weights=mode)
                out = eng.generate([[5, 6, 7, 8]], params)[0].token_ids
                net = eng.loaded.model
                lin = weights = 0
                for layer in net.layers:
                    for key, sw in layer.stored.items():
                        dense = getattr(layer.attn if key in ("qkv", "o") else layer.mlp, key)
                        lin += sw.blocks.numel() * sw.blocks.element_size()
                        weights += sw.shape[0] * dense.shape[1]  # (a released weight keeps its K: [0, K])
                runs[mode] = (resident_weight_bytes(net), lin / weights if weights else 0.0, list(out))
            deq = runs.get("dequantized")
            st = runs["stored"]
            same = "n/a (W8A8 runs only as W8A8)" if deq is None else ("yes" if deq[2] == st[2] else "no (bf16 ties)")
            print(f"| {name} | {deq[0] if deq else '—'} | {st[0]} | {st[1]:.3f} | {same} |")


if __name__ == "__main__":
    main()
