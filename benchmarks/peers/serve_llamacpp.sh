#!/usr/bin/env bash
# Serve the embedded GGUF with llama-server on 127.0.0.1:${1:-8080}: 32 parallel slots, 2 threads.
source "$(dirname "$0")/common.sh"
PORT="${1:-8080}"
exec "$PEERS/llamacpp/build/bin/llama-server" -m "$GGUF" --host 127.0.0.1 --port "$PORT" \
  -t 2 -np 32 -c 65536 --no-webui  # 2,048 tokens per slot: the shared-prefix prompts need 1,400
