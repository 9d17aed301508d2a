# Shared settings for the peer scripts (sourced). Everything lives under .peers/ (git-ignored).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PEERS="$ROOT/.peers"
PY="$ROOT/.venv/bin/python"
mkdir -p "$PEERS"
# The embedded GGUF, found without importing its package (see shared/DESIGN.md).
GGUF="$("$PY" -c 'from tripod.loader.embedded import embedded_model_path; print(embedded_model_path())')"
wait_healthy() {  # URL PATH SECONDS
  local deadline=$((SECONDS + $3))
  until curl -sf "$1$2" > /dev/null; do
    if (( SECONDS > deadline )); then echo "no answer from $1$2 after $3 s" >&2; return 1; fi
    sleep 1
  done
}
