#!/usr/bin/env bash
# Serve the embedded GGUF with llama-server on 127.0.0.1:${1:-8080}: 32 parallel slots, 2 threads.
source "$(dirname "$0")/common.sh"
PORT="${1:-8080}"
BIN="$(llamacpp_bin)"
# A binary built for another kind of CPU dies with "Illegal instruction" mid-run: refuse it here.
llamacpp_isa check "$(dirname "$BIN")"
exec "$BIN" -m "$GGUF" --host 127.0.0.1 --port "$PORT" \
  -t 2 -np 32 -c 65536 --no-webui  # 2,048 tokens per slot: the shared-prefix prompts need 1,400
