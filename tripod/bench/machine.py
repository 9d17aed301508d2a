"""The machine a benchmark ran on, as /proc/cpuinfo describes it (torch-free).

A record that says only "AMD EPYC, 2 cores" cannot tell an AVX2-only Zen 3 from an AVX-512 Zen 4,
and the two run the same kernels at very different speeds: every bench record carries the CPU's
identity (vendor, family/model/stepping) and the ISA flags that pick a compute path.

    python -m tripod.bench.machine            # this machine, as JSON
"""

from __future__ import annotations

import json
import os
import platform
import sys
from typing import Any

from tripod.kernels.build import AVX_LEVELS, NEEDED_FLAGS

# The flags that decide which kernels can run (tripod's and its peers'), in the order shown.
ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni",
             "amx_tile", "amx_bf16", "amx_int8")
ISA_LEVELS = (*AVX_LEVELS, "baseline")  # best first


def isa_level(flags: set[str]) -> str:
    """One word for the best level of tripod's kernels the flags allow (avx512_bf16, avx512, avx2),
    or baseline. AMX is not a level: these VMs list it without granting it (see benchmarks/peers)."""
    return next((lv for lv in AVX_LEVELS if all(f in flags for f in NEEDED_FLAGS[lv])), "baseline")


def cpu_flags(cpuinfo: str) -> set[str]:
    """The first processor's feature flags (``flags`` on x86, ``Features`` on Arm)."""
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def _first(cpuinfo: str, key: str) -> str | None:
    for line in cpuinfo.splitlines():
        k, sep, value = line.partition(":")
        if sep and k.strip() == key:
            return value.strip()
    return None


def _int(text: str | None) -> int | None:
    try:
        return int(text, 0) if text is not None else None  # Arm writes "CPU part : 0xd0c"
    except ValueError:
        return None


def parse_cpuinfo(cpuinfo: str) -> dict[str, Any]:
    """The CPU's identity and ISA from /proc/cpuinfo text (the first processor speaks for all)."""
    flags = cpu_flags(cpuinfo)
    return {
        "cpu": _first(cpuinfo, "model name"),
        "vendor": _first(cpuinfo, "vendor_id"),
        "family": _int(_first(cpuinfo, "cpu family")),
        "model": _int(_first(cpuinfo, "model")),
        "stepping": _int(_first(cpuinfo, "stepping")),
        "isa_level": isa_level(flags),
        "isa": {f: f in flags for f in ISA_FLAGS},
    }


def read_cpuinfo() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return f.read()
    except OSError:
        return ""  # not Linux: identity from platform only, ISA baseline


def describe(cpuinfo: str | None = None, cores: int | None = None) -> dict[str, Any]:
    """The bench record's ``machine``: :func:`parse_cpuinfo` of ``cpuinfo`` (default: this
    machine's), the core count, the OS and Python."""
    info = parse_cpuinfo(read_cpuinfo() if cpuinfo is None else cpuinfo)
    info["cpu"] = info["cpu"] or platform.processor() or platform.machine() or "unknown"
    return {**info, "cores": cores if cores is not None else os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version()}


def summary(machine: dict[str, Any]) -> str:
    """One line for a report: "AMD EPYC 7B13 (AuthenticAMD family 25 model 1 stepping 0), 2 cores,
    ISA avx2: avx2 fma f16c". Older records (cpu and cores only) read as far as they go."""
    ident = " ".join(f"{k} {machine[k]}" for k in ("family", "model", "stepping") if machine.get(k) is not None)
    ident = " ".join(x for x in (machine.get("vendor"), ident) if x)
    parts = [f"{machine.get('cpu') or 'unknown CPU'}{f' ({ident})' if ident else ''}"]
    if machine.get("cores"):
        parts.append(f"{machine['cores']} cores")
    if machine.get("isa_level"):
        on = [f for f, has in (machine.get("isa") or {}).items() if has]
        parts.append(f"ISA {machine['isa_level']}" + (f": {' '.join(on)}" if on else ""))
    return ", ".join(parts)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    text = None
    if argv:  # a saved cpuinfo, e.g. another machine's
        with open(argv[0]) as f:
            text = f.read()
    print(json.dumps(describe(text), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
