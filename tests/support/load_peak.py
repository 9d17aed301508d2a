"""The peak resident memory of loading a model, measured in a fresh Python process: what the
process holds after importing tripod and its high-water mark once an ``Engine`` over the model is
built (load, stored form, the dense copies given back) — bytes, not time. The high-water mark is the
process's ``VmHWM`` (``/proc/self/status``), reset to the current size after the imports by writing 5
to ``/proc/self/clear_refs``; ``ru_maxrss`` is not used because Linux carries it over from the parent
across fork and exec (a test process holding a model would set it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

_CHILD = r"""
import json, sys
import torch, tripod
from tripod import Engine
from tripod.engine.executor.group import resident_weight_bytes
import tripod.kernels

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS
before = status("VmRSS")
eng = Engine(model=sys.argv[1], dtype=sys.argv[2], weights=sys.argv[3], kv_cache_tokens=64, chunk_size=16,
             max_batch_tokens=32, max_running=2)
print(json.dumps({"before": before, "peak": status("VmHWM"), "after": status("VmRSS"),
                  "weight_bytes": resident_weight_bytes(eng.loaded.model), "weights": eng.loaded.weights}))
"""


def load_peak(folder: Path, dtype: str = "bfloat16", weights: str = "stored", root: Path | None = None) -> dict[str, Any]:
    """``{"before", "peak", "after", "weight_bytes", "weights"}`` (bytes) of building an Engine over ``folder``
    in a fresh interpreter (one thread, so thread pools add nothing); ``root``: the tripod tree to
    import (default: this one; a benchmark compares an older tree's loader)."""
    root = root or Path(__file__).resolve().parents[2]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)}
    out = subprocess.run([sys.executable, "-c", _CHILD, str(folder), dtype, weights], capture_output=True,
                         text=True, env=env, timeout=600, check=False, cwd=str(root))
    if out.returncode != 0:
        raise RuntimeError(f"the load process failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])
