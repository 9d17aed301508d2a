"""tripod's own CPU kernels (C++), one library per ISA level, compiled on the machine that runs them.

The sources (``csrc/``) are written once over a 16-lane vector type (``csrc/simd.h``) and
compiled per level (``build.LEVELS``: ``amx_bf16``, ``avx512_bf16``, ``avx512``, ``avx2``), each
checked in a separate process and cached on disk (``$TRIPOD_CACHE_DIR/kernels/<level>-<hash>/``).
The AVX levels compute the same bits; ``amx_bf16`` sums in the tiles' order (its own bits). The best
one the CPU supports runs (``best_level``: ``amx_bf16`` where Linux grants the tiles and its build
passed its self-test), and a test or a user may force another (``--kernels avx2``, or the test level
``amx_emu``: the tile code on emulated tile instructions). ``make install`` builds every level the CPU
supports; otherwise the first engine that wants one builds it in the background (about 20 s on
2 cores) and keeps serving on torch's ops until it is ready. Without a compiler or AVX2, tripod
runs on torch's ops only and says why.

    python -m tripod.kernels build     # build every level this CPU supports; non-zero if one fails
    python -m tripod.kernels status    # what this CPU supports, what is built, what runs
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any

from tripod.kernels.build import (
    LEVELS,
    OPT_IN_LEVELS,
    KernelBuild,
    cpu_flags,
    level_reason,
    namespace,
    supported_levels,
)

log = logging.getLogger(__name__)

_lock = threading.Lock()


@dataclass(slots=True)
class _Level:
    """One level's state in this process: loaded, failed (why), or building in a thread."""

    loaded: bool = False
    failed: str | None = None
    thread: threading.Thread | None = None


_levels: dict[str, _Level] = {lv: _Level() for lv in (*LEVELS, *OPT_IN_LEVELS)}


def best_level() -> str | None:
    """The best level this CPU supports (None: none, e.g. not x86-64 or no AVX2): ``amx_bf16`` where
    the CPU has AMX-BF16, Linux grants the tiles and the level's build passed its self-test (``python
    -m tripod.kernels build`` makes it; ``make install`` runs that), else the best AVX level, saying
    once why not AMX. A level never changes under a running process (its bits are its own)."""
    levels = supported_levels()
    if "amx_bf16" in levels:
        why = _amx_obstacle()
        if why is None:
            return "amx_bf16"
        levels.remove("amx_bf16")
    else:
        why = level_reason("amx_bf16")
    if levels:
        _say_why_not_amx(why, levels[0])
    return levels[0] if levels else None


def _amx_obstacle() -> str | None:
    """Why a CPU that can run amx_bf16 does not run it by default (None: it does)."""
    state = _levels["amx_bf16"]
    if state.failed is not None:
        return state.failed
    build = _build_of("amx_bf16")
    if build.is_built():
        return None
    failed = build.failed_reason()
    if failed is not None:
        return f"its build failed: {failed.splitlines()[-1] if failed.splitlines() else failed}"
    return build.unsupported_reason() or "it is not built yet (python -m tripod.kernels build builds it; make install does)"


@functools.cache
def _say_why_not_amx(why: str | None, level: str) -> None:
    # NOTE: cached: best_level() is asked on every start-up and heartbeat; the reason is said once.
    log.info("tripod's CPU kernels run %s, not amx_bf16: %s", level, why)


def _resolve(level: str | None) -> str | None:
    if level is None:
        return best_level()
    if level not in _levels:
        raise ValueError(f"unknown kernel level {level!r} (one of {', '.join((*LEVELS, *OPT_IN_LEVELS))})")
    return level


def ops(level: str | None = None) -> Any | None:
    """``torch.ops.tripod_<level>`` once that level is loaded in this process, else None."""
    lv = _resolve(level)
    if lv is None or not _levels[lv].loaded:
        return None
    import torch

    return getattr(torch.ops, namespace(lv))


def ready(level: str | None = None) -> bool:
    lv = _resolve(level)
    return lv is not None and _levels[lv].loaded


def building(level: str | None = None) -> bool:
    """Whether a background build of ``level`` (None: any level) runs in this process."""
    states = _levels.values() if level is None else [_levels[level]]
    return any(s.thread is not None and s.thread.is_alive() for s in states)


@functools.cache
def _build_of(level: str) -> KernelBuild:
    # NOTE: once per process: a KernelBuild hashes the sources, and unavailable_reason() is asked
    # on every heartbeat (the engine stats' compute card).
    return KernelBuild(level)


def unavailable_reason(level: str | None = None) -> str | None:
    """Why ``level`` (None: the best this CPU supports) cannot be used here (None: it can, or may
    still build)."""
    lv = _resolve(level)
    if lv is None:
        return _no_level_reason()
    return _levels[lv].failed or _build_of(lv).unsupported_reason()


def _no_level_reason() -> str:
    why = level_reason("avx2")
    return f"{why or 'no level is supported'} (tripod's CPU kernels need at least AVX2, FMA and F16C)"


def load(level: str | None = None, *, wait: bool = True) -> bool:
    """Load ``level`` (None: the best this CPU supports), building it first if needed (in a
    background thread that runs the build in its own process). ``wait=False`` returns at once:
    True only if it was already built and is now loaded; otherwise it loads when the build ends
    (``ready()``)."""
    lv = _resolve(level)
    if lv is None:
        return False
    state = _levels[lv]
    with _lock:
        if state.loaded or state.failed is not None:
            return state.loaded
        build = _build_of(lv)
        why = build.unsupported_reason()
        if why is not None:
            _fail(lv, why)
            return False
        if build.is_built():
            _load_library(lv, build)
            return state.loaded
        if state.thread is None:
            state.thread = threading.Thread(target=_build_and_load, args=(lv, build), name=f"tripod-kernels-{lv}", daemon=True)
            state.thread.start()
        thread = state.thread
    if wait:
        thread.join()
    return state.loaded


def wait(timeout: float | None = None, level: str | None = None) -> bool:
    """Wait for a background build started by ``load(wait=False)``; True once loaded."""
    lv = _resolve(level)
    if lv is None:
        return False
    t = _levels[lv].thread
    if t is not None:
        t.join(timeout)
    return _levels[lv].loaded


def _build_and_load(level: str, build: KernelBuild) -> None:
    # NOTE: the build runs in its own process group, not in this thread: if this process goes
    # away (a replica stopped or restarted mid-build) the build still finishes and lands in the
    # cache, so the next start (or another replica, waiting on the build's lock) uses it.
    import subprocess
    import sys

    log.info("building tripod's %s CPU kernels in the background (once per machine; ~20 s)", level)
    try:
        res = subprocess.run(
            [sys.executable, "-m", "tripod.kernels", "build", "--level", level],
            capture_output=True, text=True, start_new_session=True, timeout=1800,
            preexec_fn=lambda: os.nice(10),  # serving (on torch's ops meanwhile) comes first
        )
    except Exception as e:  # any failure means: keep running on torch's ops, and say why
        _fail(level, f"building the {level} kernels failed: {e}")
        return
    if res.returncode != 0 or not build.is_built():
        _fail(level, f"building the {level} kernels failed: {(res.stderr or res.stdout).strip()[-2000:]}")
        return
    with _lock:
        _load_library(level, build)


def _load_library(level: str, build: KernelBuild) -> None:
    import torch

    state = _levels[level]
    if state.loaded:  # a background build and a waiting caller may both get here
        return
    try:
        torch.ops.load_library(str(build.library))
    except Exception as e:
        _fail(level, f"loading {build.library} failed: {e}")
        return
    state.loaded = True
    log.info("tripod %s CPU kernels loaded from %s", level, build.library)


def _fail(level: str, why: str) -> None:
    _levels[level].failed = why
    log.warning("tripod %s CPU kernels unavailable, using torch's ops: %s", level, why)


__all__ = [
    "LEVELS", "best_level", "building", "cpu_flags", "load", "ops", "ready", "supported_levels",
    "unavailable_reason", "wait",
]
