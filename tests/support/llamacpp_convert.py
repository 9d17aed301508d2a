"""llama.cpp's own ``convert_hf_to_gguf.py``, fetched and run for the GGUF tests (no hub needed).

The converter comes from the llama.cpp sources vendored in the ``llama-cpp-python`` sdist (what
``benchmarks/peers/setup_llamacpp.sh`` builds llama-server from), fetched once with ``pip download``
and cached under ``~/.cache/tripod/llamacpp-convert/<version>`` (only the converter, its
``conversion`` package and its ``gguf-py`` are kept). ``convert`` runs it in a subprocess with that
``gguf-py`` first on the path, as llama.cpp's own scripts do.

The tiny checkpoints borrow the embedded SmolLM2 tokenizer; transformers loads it as
``Qwen3_5Tokenizer`` for some Qwen model types, whose pre-tokenizer hash the converter does not list:
the runner then tells the converter the vocabulary's own pre-tokenizer (``smollm``). The weights are
converted by llama.cpp's code untouched.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from tripod import paths

# The newest release whose converter registers Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM / Qwen3NextForCausalLM.
VERSION = "0.3.36"

_RUNNER = '''
import runpy, sys
root = sys.argv[1]
sys.path.insert(0, root)
sys.path.insert(0, root + "/gguf-py")
import conversion.base as base
known = base.TextModel.get_vocab_base_pre
def pre(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:
        return "smollm"
base.TextModel.get_vocab_base_pre = pre
sys.argv = [root + "/convert_hf_to_gguf.py", *sys.argv[2:]]
runpy.run_path(sys.argv[0], run_name="__main__")
'''


def converter_dir() -> Path:
    """The cached converter folder, fetched with pip the first time. Raises RuntimeError with the
    reason when it cannot be fetched."""
    root = paths.cache_dir() / "llamacpp-convert" / VERSION
    if (root / "convert_hf_to_gguf.py").is_file() and (root / "conversion").is_dir():
        return root
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
               f"llama-cpp-python=={VERSION}", "-d", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        sdists = list(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        if done.returncode != 0 or not sdists:
            raise RuntimeError(f"could not fetch llama.cpp's converter ({' '.join(cmd)}): "
                               f"{done.stderr.strip()[-2000:] or 'no sdist downloaded'}")
        staging = Path(tmp) / "src"
        with tarfile.open(sdists[0]) as tar:
            keep = [m for m in tar.getmembers()
                    if "/vendor/llama.cpp/" in m.name and m.name.split("/vendor/llama.cpp/", 1)[1].startswith(
                        ("convert_hf_to_gguf.py", "conversion/", "gguf-py/"))]
            safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}  # (Python >= 3.11.4)
            tar.extractall(staging, members=keep, **safe)
        (src,) = staging.glob("*/vendor/llama.cpp")
        root.parent.mkdir(parents=True, exist_ok=True)
        partial = root.with_name(root.name + f".tmp{os.getpid()}")
        shutil.copytree(src, partial)
        if root.exists():
            shutil.rmtree(partial, ignore_errors=True)
        else:
            os.replace(partial, root)
    return root


def convert(folder: Path, out: Path, outtype: str, no_mtp: bool = False) -> Path:
    """``folder`` (an HF checkpoint) converted by llama.cpp to ``out`` at ``outtype`` (f32, f16, q8_0).
    ``no_mtp``: leave out multi-token-prediction layers (the Qwen hybrids' converter needs to be told
    when the checkpoint has none; others refuse the flag)."""
    root = converter_dir()
    env = {**os.environ, "PYTHONPATH": str(root / "gguf-py"), "NO_LOCAL_GGUF": "1"}
    cmd = [sys.executable, "-c", _RUNNER, str(root), str(folder), *(["--no-mtp"] if no_mtp else []),
           "--outtype", outtype, "--outfile", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if done.returncode != 0 or not out.is_file():
        raise RuntimeError(f"llama.cpp's converter failed on {folder}:\n{done.stderr[-4000:]}")
    return out
