"""The ISA a llama.cpp build targets: cmake flags chosen from this host's /proc/cpuinfo flags.

Not ``GGML_NATIVE``: these VMs list AMX in /proc/cpuinfo without the kernel granting it, and a
native build dies with SIGILL in ggml's AMX path. Naming AVX-512 unconditionally is no better:
on an AVX2-only Zen 3 the binary dies with "Illegal instruction". So every feature is named, ON
exactly where the host lists it, AMX always OFF.

    llamacpp_isa.py [--cpuinfo FILE] build-dir         # build-avx2, build-avx512_bf16-vbmi-vnni, ...
    llamacpp_isa.py [--cpuinfo FILE] cmake-flags       # -DGGML_...=ON|OFF, one a line
    llamacpp_isa.py [--cpuinfo FILE] record BIN_DIR [CMAKE_FLAG...]   # BIN_DIR/llama-server.isa.json
    llamacpp_isa.py [--cpuinfo FILE] check BIN_DIR     # exit 1 unless that build fits this host
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from tripod.bench.machine import cpu_flags, describe, read_cpuinfo

# ggml option → the cpuinfo flags it compiles for (ggml/src/ggml-cpu/CMakeLists.txt, x86).
BASE = (("SSE42", ("sse4_2",)), ("AVX", ("avx",)), ("AVX2", ("avx2",)), ("BMI2", ("bmi2",)), ("FMA", ("fma",)),
        ("F16C", ("f16c",)), ("AVX_VNNI", ("avx_vnni",)))
# GGML_AVX512 compiles with -mavx512f -mavx512cd -mavx512vl -mavx512dq -mavx512bw: all five or none.
AVX512 = ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw")
AVX512_EXTRAS = (("AVX512_VBMI", "avx512vbmi"), ("AVX512_VNNI", "avx512_vnni"), ("AVX512_BF16", "avx512_bf16"))
AMX = ("AMX_TILE", "AMX_INT8", "AMX_BF16")  # always OFF: listed but not granted on these VMs
RECORD = "llama-server.isa.json"


def ggml_features(flags: set[str]) -> dict[str, bool]:
    """Each ggml ISA option, ON where the host lists every flag it needs."""
    on = {name: all(f in flags for f in need) for name, need in BASE}
    on["AVX512"] = all(f in flags for f in AVX512)
    for name, flag in AVX512_EXTRAS:
        on[name] = on["AVX512"] and flag in flags
    on.update(dict.fromkeys(AMX, False))
    return on


def cmake_flags(flags: set[str]) -> list[str]:
    """The ``-D`` flags that build llama.cpp for exactly this host's ISA."""
    return ["-DGGML_NATIVE=OFF", *(f"-DGGML_{k}={'ON' if v else 'OFF'}" for k, v in ggml_features(flags).items())]


def level(flags: set[str]) -> str:
    """The build's ISA level, and the extensions it uses beyond it: the build folder's name
    (``build-<level>``), so that a machine of another kind never picks up a wrong binary."""
    on = ggml_features(flags)
    if on["AVX512"]:
        name = "avx512_bf16" if on["AVX512_BF16"] else "avx512"
        extras = [x for x, k in (("vbmi", "AVX512_VBMI"), ("vnni", "AVX512_VNNI")) if on[k]]
    else:
        name = "avx2" if on["AVX2"] and on["FMA"] and on["F16C"] else "baseline"
        extras = ["avxvnni"] if on["AVX_VNNI"] else []
    return "-".join([name, *extras])


def record(cpuinfo: str, used: list[str]) -> dict[str, Any]:
    """What a build was made with and for: the level, its ISA flags, every cmake flag passed, and
    the machine (tripod.bench.machine) it was built on."""
    flags = cpu_flags(cpuinfo)
    return {"isa_level": level(flags), "build_dir": f"build-{level(flags)}", "isa_flags": cmake_flags(flags),
            "cmake_flags": used or cmake_flags(flags), "machine": describe(cpuinfo),
            "built": time.strftime("%Y-%m-%dT%H:%M:%S")}


def mismatch(recorded: dict[str, Any], cpuinfo: str) -> str | None:
    """Why a recorded build must not run on this host (None: it fits)."""
    want = cmake_flags(cpu_flags(cpuinfo))
    if recorded.get("isa_flags") == want:
        return None
    have, need = set(recorded.get("isa_flags") or []), set(want)
    return (f"built for {recorded.get('isa_level')} ({' '.join(sorted(have - need)) or '?'}), this host needs "
            f"{level(cpu_flags(cpuinfo))} ({' '.join(sorted(need - have))})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpuinfo", default=None, help="read this file instead of /proc/cpuinfo")
    p.add_argument("action", choices=["build-dir", "cmake-flags", "record", "check"])
    p.add_argument("bin_dir", nargs="?", help="record/check: the folder holding llama-server")
    p.add_argument("used", nargs=argparse.REMAINDER, help="record: every cmake flag the build was given")
    args = p.parse_args(argv)
    cpuinfo = Path(args.cpuinfo).read_text() if args.cpuinfo else read_cpuinfo()
    flags = cpu_flags(cpuinfo)
    if args.action == "build-dir":
        print(f"build-{level(flags)}")
    elif args.action == "cmake-flags":
        print("\n".join(cmake_flags(flags)))
    elif not args.bin_dir:
        p.error(f"{args.action} needs BIN_DIR")
    elif args.action == "record":
        path = Path(args.bin_dir) / RECORD
        path.write_text(json.dumps(record(cpuinfo, args.used), indent=2) + "\n")
        print(path)
    else:
        path = Path(args.bin_dir) / RECORD
        if not path.is_file():
            print(f"{path}: no record of what this llama-server was built for; run setup_llamacpp.sh", file=sys.stderr)
            return 1
        why = mismatch(json.loads(path.read_text()), cpuinfo)
        if why is not None:
            print(f"{args.bin_dir}/llama-server {why}: run setup_llamacpp.sh", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
