"""``python -m tripod.kernels build|status``: build the CPU kernels ahead of time (``make
install`` does), or say where they are and why not."""

from __future__ import annotations

import sys

from tripod.kernels.build import KernelBuild


def main(argv: list[str]) -> int:
    # --strict: exit 1 when they cannot be built (the engine's background build reads it).
    strict = "--strict" in argv
    argv = [a for a in argv if a != "--strict"]
    what = argv[0] if argv else "status"
    build = KernelBuild()
    why = build.unsupported_reason()
    if what == "status":
        if why:
            print(f"unavailable: {why}")
        elif build.is_built():
            print(f"built: {build.library}")
        else:
            print(f"not built yet (python -m tripod.kernels build): {build.library}")
        return 0
    if what == "build":
        if why:
            # Not an error: tripod runs on torch's ops without them.
            print(f"tripod CPU kernels not built: {why}; tripod will use torch's ops")
            return 1 if strict else 0
        try:
            secs = build.build()
        except RuntimeError as e:
            print(f"tripod CPU kernels not built ({e}); tripod will use torch's ops", file=sys.stderr)
            return 1 if strict else 0
        print(f"tripod CPU kernels ready in {secs:.1f} s: {build.library}")
        return 0
    print("usage: python -m tripod.kernels [build|status] [--strict]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
