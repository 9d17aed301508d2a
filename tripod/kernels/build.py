"""Compiling ``csrc/cpu_kernels.cpp`` into a torch op library, checked and cached on disk.

One build per (source, compiler flags, torch version, CPU features): the hash names the cache
folder, so a machine of another kind (or a new torch) never loads a library built elsewhere.
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

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = (CSRC / "cpu_kernels.cpp", CSRC / "linear.cpp")
NEEDED_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "fma")
# NOTE: -march=native, but never AMX: some VMs list AMX in cpuid without granting it to the
# process (ggml's native build dies with SIGILL there). No code here uses AMX anyway.
BASE_FLAGS = [
    "-O3", "-march=native", "-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16",
    "-ffp-contract=off", "-fPIC", "-shared", "-std=c++20", "-fopenmp", "-w",
]


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _cache_root() -> Path:
    from tripod.loader.gguf_loader import default_cache_dir

    return default_cache_dir() / "kernels"


class KernelBuild:
    """Where this machine's build lives, whether it can exist, and how to make it."""

    def __init__(self) -> None:
        import torch

        self.torch_dir = Path(torch.__file__).resolve().parent
        self.compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
        flags = cpu_flags()
        abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
        self.flags = [*BASE_FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
        key = "\n".join([
            *(f.read_text() if f.is_file() else "" for f in SOURCES),
            " ".join(self.flags),
            torch.__version__,
            str(self.compiler),
            " ".join(sorted(flags)),
            platform.machine(),
        ])
        digest = hashlib.sha256(key.encode()).hexdigest()[:16]
        self.folder = _cache_root() / digest
        self.library = self.folder / "tripod_cpu.so"
        self.stamp = self.folder / "checked"
        self._cpu = flags

    def unsupported_reason(self) -> str | None:
        if not sys.platform.startswith("linux") or platform.machine() != "x86_64":
            return f"the CPU kernels are built for Linux on x86-64 (this is {sys.platform}/{platform.machine()})"
        missing = [f for f in NEEDED_FLAGS if f not in self._cpu]
        if missing:
            return f"this CPU lacks {', '.join(missing)} (the kernels need AVX-512)"
        if not self.compiler:
            return "no C++ compiler found (set CXX or install g++)"
        if not (self.torch_dir / "include" / "ATen" / "ATen.h").is_file():
            return f"torch's C++ headers are missing from {self.torch_dir / 'include'}"
        missing_src = [str(f) for f in SOURCES if not f.is_file()]
        if missing_src:
            return f"the kernel sources are missing: {', '.join(missing_src)}"
        return None

    def is_built(self) -> bool:
        return self.library.is_file() and self.stamp.is_file()

    def command(self, output: Path) -> list[str]:
        inc = self.torch_dir / "include"
        lib = self.torch_dir / "lib"
        return [
            str(self.compiler), *self.flags, f"-I{inc}", f"-I{inc / 'torch' / 'csrc' / 'api' / 'include'}",
            *(str(f) for f in SOURCES), "-o", str(output), f"-L{lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib}",
        ]

    def build(self, timeout: float = 600.0) -> float:
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
            for stale in self.folder.glob("tripod_cpu.*.so"):  # a builder killed mid-way
                stale.unlink(missing_ok=True)
            tmp = self.folder / f"tripod_cpu.{os.getpid()}.so"
            try:
                res = subprocess.run(self.command(tmp), capture_output=True, text=True, timeout=timeout)
                if res.returncode != 0:
                    raise RuntimeError(f"compiler failed ({res.returncode}):\n{res.stderr[-4000:]}")
                check = subprocess.run(
                    [sys.executable, "-m", "tripod.kernels.selftest", str(tmp)],
                    capture_output=True, text=True, timeout=timeout,
                )
                if check.returncode != 0:
                    raise RuntimeError(
                        f"the self-check of the built kernels failed (exit {check.returncode}):\n"
                        f"{(check.stdout + check.stderr)[-4000:]}"
                    )
                os.replace(tmp, self.library)
                self.stamp.write_text(check.stdout)
            finally:
                tmp.unlink(missing_ok=True)
        return time.monotonic() - t0
