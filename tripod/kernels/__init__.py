"""tripod's own CPU kernels (C++, AVX-512), compiled on the machine that runs them.

The source (``csrc/cpu_kernels.cpp``) is compiled once per machine kind with the system's C++
compiler against the installed torch, checked in a separate process, and cached on disk
(``$TRIPOD_CACHE_DIR/kernels/<hash>/``). ``make install`` builds it ahead of time; otherwise the
first engine that wants it builds it in the background (about 10 s on 2 cores) and keeps
serving on torch's own ops until it is ready. Without a compiler or AVX-512, tripod runs on
torch's ops only: nothing here is required.

    python -m tripod.kernels build     # build (or find) the kernels; prints where and why not
    python -m tripod.kernels status
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from typing import Any

from tripod.kernels.build import KernelBuild, cpu_flags

log = logging.getLogger(__name__)

_lock = threading.Lock()
_loaded = False
_failed: str | None = None
_thread: threading.Thread | None = None


def ops() -> Any | None:
    """``torch.ops.tripod_cpu`` once the kernels are loaded in this process, else None."""
    if not _loaded:
        return None
    import torch

    return torch.ops.tripod_cpu


def ready() -> bool:
    return _loaded


def building() -> bool:
    """Whether a background build is running in this process (started by ``load(wait=False)``)."""
    return _thread is not None and _thread.is_alive()


def unavailable_reason() -> str | None:
    """Why the kernels cannot be used on this machine (None: they can, or may still build)."""
    return _failed or _machine_reason()


@functools.cache
def _machine_reason() -> str | None:
    return KernelBuild().unsupported_reason()


def load(*, wait: bool = True) -> bool:
    """Load the kernels, building them first if needed (in a background thread that runs the
    build in its own process). ``wait=False`` returns at once: True only if they were already
    built and are now loaded; otherwise they load when the build ends (``ready()``)."""
    global _thread
    with _lock:
        if _loaded or _failed is not None:
            return _loaded
        build = KernelBuild()
        why = build.unsupported_reason()
        if why is not None:
            _fail(why)
            return False
        if build.is_built():
            _load_library(build)
            return _loaded
        if _thread is None:
            _thread = threading.Thread(target=_build_and_load, args=(build,), name="tripod-kernels", daemon=True)
            _thread.start()
        thread = _thread
    if wait:
        thread.join()
    return _loaded


def wait(timeout: float | None = None) -> bool:
    """Wait for a background build started by ``load(wait=False)``; True once loaded."""
    t = _thread
    if t is not None:
        t.join(timeout)
    return _loaded


def _build_and_load(build: KernelBuild) -> None:
    # NOTE: the build runs in its own process group, not in this thread: if this process goes
    # away (a replica stopped or restarted mid-build) the build still finishes and lands in the
    # cache, so the next start (or another replica, waiting on the build's lock) uses it.
    import subprocess
    import sys

    log.info("building tripod's CPU kernels in the background (once per machine; ~20 s)")
    try:
        res = subprocess.run(
            [sys.executable, "-m", "tripod.kernels", "build", "--strict"],
            capture_output=True, text=True, start_new_session=True, timeout=1800,
            preexec_fn=lambda: os.nice(10),  # serving (on torch's ops meanwhile) comes first
        )
    except Exception as e:  # any failure means: keep running on torch's ops, and say why
        _fail(f"building the CPU kernels failed: {e}")
        return
    if res.returncode != 0 or not build.is_built():
        _fail(f"building the CPU kernels failed: {(res.stderr or res.stdout).strip()[-2000:]}")
        return
    with _lock:
        _load_library(build)


def _load_library(build: KernelBuild) -> None:
    global _loaded
    import torch

    if _loaded:  # a background build and a waiting caller may both get here
        return
    try:
        torch.ops.load_library(str(build.library))
    except Exception as e:
        _fail(f"loading {build.library} failed: {e}")
        return
    _loaded = True
    log.info("tripod CPU kernels loaded from %s", build.library)


def _fail(why: str) -> None:
    global _failed
    _failed = why
    log.warning("tripod CPU kernels unavailable, using torch's ops: %s", why)


__all__ = ["building", "cpu_flags", "load", "ops", "ready", "unavailable_reason", "wait"]
