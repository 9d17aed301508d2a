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
wait_healthy() {  # URL PATH SECONDS
  local deadline=$((SECONDS + $3))
  until curl -sf "$1$2" > /dev/null; do
    if (( SECONDS > deadline )); then echo "no answer from $1$2 after $3 s" >&2; return 1; fi
    sleep 1
  done
}
