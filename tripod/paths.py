"""Where tripod keeps what it makes once and reuses: ``$TRIPOD_CACHE_DIR``, else
``$XDG_CACHE_HOME/tripod`` (``~/.cache/tripod``). Kernel builds live under ``kernels/``, converted
tokenizers next to the GGUF name they came from. Torch-free: the kernels' build process reads it."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    env = os.environ.get("TRIPOD_CACHE_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tripod"
