"""Compiling the kernel sources into one torch op library per ISA level, checked and cached on disk.

Levels, best first (``LEVELS``): ``amx_bf16`` (AMX-BF16 tiles for the bf16 linears and stored
blocks, the rest as ``avx512_bf16``), ``avx512_bf16`` (AVX-512 with ``vdpbf16ps``), ``avx512``, and
``avx2`` (AVX2 + FMA + F16C: every x86-64 CPU of the last decade). Each is compiled with its own
explicit flags (never ``-march=native``: some VMs list AMX in cpuid without granting it, and a
build must run on any CPU of its level) and registers its ops under its own namespace
(``torch.ops.tripod_avx2`` ...). The AVX levels (``AVX_LEVELS``) compute the same bits as each
other (``csrc/simd.h``); the tile levels (``TILE_LEVELS``) sum bf16 products in TDPBF16PS' order,
so their bits are their own. ``amx_emu`` (``OPT_IN_LEVELS``: built and run only when named) is
``amx_bf16``'s source over an emulation of the tile instructions (``csrc/amx.h``): the tile code
paths tested on any CPU with AVX512-BF16.

One build per (level, sources, flags, torch version, compiler): the hash names the cache folder.
Concurrent builders (a fleet's replicas starting together) take a file lock; the first builds,
the others find its result. A build is only used after a separate process has loaded it and
checked every op against torch on small inputs (an illegal instruction there cannot take the
engine down with it).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

from tripod import paths

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = (CSRC / "cpu_kernels.cpp", CSRC / "linear.cpp", CSRC / "recurrent.cpp", CSRC / "int8.cpp")
HEADERS = (CSRC / "simd.h", CSRC / "amx.h")

# Best first: the levels chosen automatically (amx_bf16 only where Linux grants the tiles and its
# build passed its self-test: tripod.kernels.best_level).
LEVELS = ("amx_bf16", "avx512_bf16", "avx512", "avx2")
AVX_LEVELS = ("avx512_bf16", "avx512", "avx2")  # bit-identical to each other
# TDPBF16PS adds a pair's even product before its odd one (vdpbf16ps: odd first), so the tile
# levels' sums are not the AVX levels' bits (batch-invariant all the same: each output row is summed
# in one fixed order at every row count); amx_emu computes amx_bf16's bits (tested on AMX hosts).
TILE_LEVELS = ("amx_bf16", "amx_emu")
# Levels run only when named (--kernels amx_emu): the tile instructions emulated, for tests.
OPT_IN_LEVELS = ("amx_emu",)
_AVX2 = ("avx2", "fma", "f16c")
_AVX512 = (*_AVX2, "avx512f", "avx512bw", "avx512vl", "avx512dq")
# The /proc/cpuinfo flags each level needs, and the compiler flags that enable exactly those.
NEEDED_FLAGS: dict[str, tuple[str, ...]] = {
    "avx2": _AVX2,
    "avx512": _AVX512,
    "avx512_bf16": (*_AVX512, "avx512_bf16"),
    "amx_bf16": (*_AVX512, "avx512_bf16", "amx_tile", "amx_bf16"),
    "amx_emu": (*_AVX512, "avx512_bf16"),
}
_ISA_FLAGS: dict[str, list[str]] = {
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "avx512": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"],
    "avx512_bf16": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16"],
    "amx_bf16": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16",
                 "-mamx-tile", "-mamx-bf16"],
    "amx_emu": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16",
                "-DTRIPOD_AMX_EMU"],
}
# NOTE: -ffp-contract=off: no multiply-add is fused unless the source writes it as one (the
# levels must compute the same bits, and the float32 kernels match torch's rounding order).
BASE_FLAGS = ["-O3", "-mtune=generic", "-ffp-contract=off", "-fPIC", "-shared", "-std=c++20", "-fopenmp", "-w"]


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def namespace(level: str) -> str:
    """The torch op namespace of a level's library (``torch.ops.<namespace>``)."""
    return f"tripod_{level}"


def level_reason(level: str, flags: set[str] | None = None) -> str | None:
    """Why this CPU cannot run ``level`` (None: it can)."""
    if level not in NEEDED_FLAGS:
        raise ValueError(f"unknown kernel level {level!r} (one of {', '.join((*LEVELS, *OPT_IN_LEVELS))})")
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"tripod's CPU kernels are for x86-64 (this machine is {platform.machine()})"
    flags = cpu_flags() if flags is None else flags
    missing = [f for f in NEEDED_FLAGS[level] if f not in flags]
    if missing:
        return f"this CPU lacks {', '.join(missing)}"
    if level == "amx_bf16":
        return amx_permission_reason()
    return None


def amx_permission_reason() -> str | None:
    """Ask Linux for AMX tile state for this process (``arch_prctl(ARCH_REQ_XCOMP_PERM,
    XFEATURE_XTILEDATA)``: without it the first tile instruction dies with SIGILL, as llama.cpp's
    AMX path does on these VMs); None when granted, else why not. The library asks again itself."""
    import ctypes
    import ctypes.util

    libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    sys_arch_prctl, req_xcomp_perm, xtiledata = 158, 0x1023, 18  # x86-64 numbers (asm/prctl.h)
    if libc.syscall(sys_arch_prctl, req_xcomp_perm, xtiledata) != 0:
        err = ctypes.get_errno()
        return f"Linux refuses AMX tile state to this process (arch_prctl ARCH_REQ_XCOMP_PERM: {os.strerror(err)})"
    return None


def supported_levels(flags: set[str] | None = None) -> list[str]:
    """The levels this CPU can run, best first (empty: none, e.g. not x86-64 or no AVX2)."""
    return [lv for lv in LEVELS if level_reason(lv, flags) is None]


def _cache_root() -> Path:
    return paths.cache_dir() / "kernels"


class KernelBuild:
    """Where one level's build lives, whether it can exist on this machine, and how to make it."""

    def __init__(self, level: str) -> None:
        import torch

        if level not in NEEDED_FLAGS:
            raise ValueError(f"unknown kernel level {level!r} (one of {', '.join((*LEVELS, *OPT_IN_LEVELS))})")
        self.level = level
        self.namespace = namespace(level)
        self.torch_dir = Path(torch.__file__).resolve().parent
        self.compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
        abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
        self.flags = [*BASE_FLAGS, *_ISA_FLAGS[level], f"-DTRIPOD_OPS_NS={self.namespace}", f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
        key = "\n".join([
            *(f.read_text() if f.is_file() else "" for f in (*SOURCES, *HEADERS)),
            " ".join(self.flags),
            torch.__version__,
            str(self.compiler),
            platform.machine(),
        ])
        digest = hashlib.sha256(key.encode()).hexdigest()[:16]
        self.folder = _cache_root() / f"{level}-{digest}"
        self.library = self.folder / f"{self.namespace}.so"
        self.stamp = self.folder / "checked"
        self.failure = self.folder / "failed"  # why the last build of these sources failed, if it did

    def unsupported_reason(self) -> str | None:
        if not sys.platform.startswith("linux"):
            return f"tripod's CPU kernels are built for Linux (this is {sys.platform})"
        why = level_reason(self.level)
        if why is not None:
            return f"{why} (the {self.level} kernels need {', '.join(NEEDED_FLAGS[self.level])})"
        if not self.compiler:
            return "no C++ compiler found (install g++, or set CXX)"
        if not (self.torch_dir / "include" / "ATen" / "ATen.h").is_file():
            return f"torch's C++ headers are missing from {self.torch_dir / 'include'}"
        missing_src = [str(f) for f in (*SOURCES, *HEADERS) if not f.is_file()]
        if missing_src:
            return f"the kernel sources are missing: {', '.join(missing_src)}"
        return None

    def is_built(self) -> bool:
        return self.library.is_file() and self.stamp.is_file()

    def failed_reason(self) -> str | None:
        """Why the last build of these sources on this machine failed (None: none failed)."""
        try:
            return self.failure.read_text().strip() or "it failed"
        except OSError:
            return None

    def command(self, output: Path) -> list[str]:
        inc = self.torch_dir / "include"
        lib = self.torch_dir / "lib"
        return [
            str(self.compiler), *self.flags, f"-I{inc}", f"-I{inc / 'torch' / 'csrc' / 'api' / 'include'}",
            *(str(f) for f in SOURCES), "-o", str(output), f"-L{lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib}",
        ]

    def build(self, timeout: float = 900.0) -> float:
        """Compile and check (unless already built); returns the seconds it took. Raises
        RuntimeError saying what failed."""
        why = self.unsupported_reason()
        if why is not None:
            raise RuntimeError(why)
        t0 = time.monotonic()
        self.folder.mkdir(parents=True, exist_ok=True)
        with open(self.folder / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building the same thing
            if self.is_built():
                return time.monotonic() - t0
            for stale in self.folder.glob(f"{self.namespace}.*.so"):  # a builder killed mid-way
                stale.unlink(missing_ok=True)
            tmp = self.folder / f"{self.namespace}.{os.getpid()}.so"
            self.failure.unlink(missing_ok=True)
            try:
                self._compile_and_check(tmp, timeout)
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                self.failure.write_text(str(e)[-4000:])
                raise RuntimeError(str(e)) from e
            finally:
                tmp.unlink(missing_ok=True)
        return time.monotonic() - t0

    def _compile_and_check(self, tmp: Path, timeout: float) -> None:
        """Compile into ``tmp``, check it in a separate process, then move it into place."""
        res = subprocess.run(self.command(tmp), capture_output=True, text=True, timeout=timeout)
        if res.returncode != 0:
            raise RuntimeError(f"the {self.level} kernels did not compile ({res.returncode}):\n{res.stderr[-4000:]}")
        check = subprocess.run(
            [sys.executable, "-m", "tripod.kernels.selftest", str(tmp), self.namespace],
            capture_output=True, text=True, timeout=timeout,
        )
        if check.returncode != 0:
            raise RuntimeError(
                f"the self-check of the {self.level} kernels failed (exit {check.returncode}):\n"
                f"{(check.stdout + check.stderr)[-4000:]}"
            )
        os.replace(tmp, self.library)
        self.stamp.write_text(check.stdout)
