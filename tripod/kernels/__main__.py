"""``python -m tripod.kernels build|status``: build every ISA level of the CPU kernels this CPU
supports ahead of time (``make install`` does), or say what this CPU supports, what is built and
which level tripod runs.

``build`` exits non-zero when an AVX level the CPU supports does not build (tripod would otherwise
serve on torch's ops at a fraction of the speed without anyone noticing); on a CPU with no level
(not x86-64, or no AVX2) it says so and exits 0: tripod runs on torch's ops there by design.
``amx_bf16`` is built too where the CPU has AMX-BF16 and Linux grants the tiles; if it does not
build or fails its self-test, ``build`` says why and still exits 0 (the best AVX level runs then,
and says so). ``--level amx_emu`` builds the test level (tile instructions emulated).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import sys

from tripod.kernels.build import (
    LEVELS,
    NEEDED_FLAGS,
    OPT_IN_LEVELS,
    KernelBuild,
    cpu_flags,
    level_reason,
    supported_levels,
)


def _status() -> int:
    flags = cpu_flags()
    shown = [f for f in ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "amx_bf16") if f in flags]
    print(f"CPU ISA flags that matter: {' '.join(shown) or '(none)'}")
    levels = supported_levels()
    for lv in (*LEVELS, *OPT_IN_LEVELS):
        why = level_reason(lv)
        if why is not None:
            print(f"  {lv:12s} unsupported: {why}")
            continue
        build = KernelBuild(lv)
        why = build.unsupported_reason()
        failed = build.failed_reason()
        state = (f"cannot build: {why}" if why else f"built: {build.library}" if build.is_built()
                 else f"build failed: {failed.splitlines()[0]}" if failed else "not built yet")
        print(f"  {lv:12s} {state}{' (test level: runs only when named)' if lv in OPT_IN_LEVELS else ''}")
    if not levels:
        print(f"tripod runs on torch's ops: this CPU runs no kernel level (they need {', '.join(NEEDED_FLAGS['avx2'])})")
    else:
        from tripod import kernels

        best = kernels.best_level() or levels[0]
        why = KernelBuild(best).unsupported_reason()
        if why:
            print(f"tripod runs on torch's ops: the {best} kernels cannot be built ({why})")
        else:
            print(f"tripod runs the {best} kernels (the best level this CPU supports; --kernels LEVEL forces another)")
    return 0


def _build_one(level: str) -> tuple[str, float | None, str | None]:
    try:
        return level, KernelBuild(level).build(), None
    except RuntimeError as e:
        return level, None, str(e)


def _build(levels: list[str]) -> int:
    if not levels:
        print(f"tripod CPU kernels not built: {level_reason('avx2')}; tripod will use torch's ops")
        return 0
    failed = 0
    # Two at a time: the machines this runs on have 2 cores; each build is one compiler process.
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        for level, secs, err in pool.map(_build_one, levels):
            if err is None:
                print(f"tripod {level} CPU kernels ready in {secs:.1f} s: {KernelBuild(level).library}")
            elif level == "amx_bf16" and len(levels) > 1:
                # The tiles are an addition: the best AVX level runs without them (and says why).
                print(f"WARNING: tripod's {level} CPU kernels were not built ({err}); the best AVX level runs instead",
                      file=sys.stderr)
            else:
                failed += 1
                print(f"ERROR: tripod's {level} CPU kernels were not built, though this CPU supports them: {err}",
                      file=sys.stderr)
    return 1 if failed else 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tripod.kernels")
    parser.add_argument("what", nargs="?", default="status", choices=["build", "status"])
    parser.add_argument("--level", choices=(*LEVELS, *OPT_IN_LEVELS),
                        help="build only this level (default: every level this CPU supports; amx_emu only when named)")
    parser.add_argument("--test-levels", action="store_true",
                        help="also build the test levels this CPU supports (amx_emu: the tile code on emulated tiles)")
    parser.add_argument("--strict", action="store_true", help=argparse.SUPPRESS)  # the old spelling; failures always exit 1
    args = parser.parse_args(argv)
    if args.what == "status":
        return _status()
    if args.level is not None:
        why = level_reason(args.level)
        if why is not None:
            print(f"ERROR: cannot build the {args.level} kernels here: {why}", file=sys.stderr)
            return 1
        return _build([args.level])
    levels = supported_levels()
    if args.test_levels and levels:
        levels += [lv for lv in OPT_IN_LEVELS if level_reason(lv) is None]
    return _build(levels)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
