# shellcheck shell=bash
# Shared settings for the peer scripts (sourced). Everything lives under .peers/ (git-ignored).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PEERS="$ROOT/.peers"
PY="$ROOT/.venv/bin/python"
mkdir -p "$PEERS"
# The embedded GGUF, found without importing its package (see shared/DESIGN.md).
# shellcheck disable=SC2034  # used by the scripts that source this one
GGUF="$("$PY" -c 'from tripod.loader.embedded import embedded_model_path; print(embedded_model_path())')"
# llama.cpp is built for this host's ISA (llamacpp_isa.py), one folder per level: build-avx2,
# build-avx512_bf16-vbmi-vnni, ...; a record of the build lies beside the binary.
LLAMACPP_ISA="$ROOT/benchmarks/peers/llamacpp_isa.py"
# LLAMACPP_CPUINFO=FILE: build / check llama.cpp for that file's flags instead of this host's
# (run_comparison.sh --isa LEVEL writes one naming only that level's features).
llamacpp_isa() { "$PY" "$LLAMACPP_ISA" ${LLAMACPP_CPUINFO:+--cpuinfo "$LLAMACPP_CPUINFO"} "$@"; }
llamacpp_bin() {  # the llama-server this host's ISA calls for (it may not be built yet)
  local dir
  dir="$(llamacpp_isa build-dir)"
  echo "$PEERS/llamacpp/$dir/bin/llama-server"
}
llamacpp_ready() {  # OUT: whether this host's llama-server build is usable (its build record copied to OUT)
  local bin
  bin="$(llamacpp_bin)"
  if [ -x "$bin" ] && llamacpp_isa check "$(dirname "$bin")"; then
    cp "$bin.isa.json" "$1/llama.cpp-build.json"  # what it was built for goes with the results
    return 0
  fi
  echo "skipping llama.cpp: no usable $bin for this CPU (run setup_llamacpp.sh)" >&2
  return 1
}
wait_healthy() {  # URL PATH SECONDS
  local deadline=$((SECONDS + $3))
  until curl -sf "$1$2" > /dev/null; do
    if (( SECONDS > deadline )); then echo "no answer from $1$2 after $3 s" >&2; return 1; fi
    sleep 1
  done
}
