"""Time from starting ``tripod serve`` to a healthy ``/health`` and to the first answer, with a
given cache folder (``TRIPOD_CACHE_DIR``: the kernels' build and the converted tokenizer).

    rm -rf /tmp/cold && .venv/bin/python benchmarks/startup_time.py /tmp/cold   # cold: nothing cached
    .venv/bin/python benchmarks/startup_time.py /tmp/cold                          # warm (after ~30 s)
    .venv/bin/python benchmarks/startup_time.py /tmp/cold --weights stored         # extra serve options

The server's log goes to ``CACHE_DIR.log``.
"""

from __future__ import annotations

import os
import sys
import time

import httpx

from tripod.fleet.process import free_port, spawn_serve, wait_healthy


def main(cache: str, serve_args: list[str]) -> int:
    os.environ["TRIPOD_CACHE_DIR"] = cache
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    with open(f"{cache}.log", "ab") as log:
        proc = spawn_serve("127.0.0.1", port, serve_args, log=log)
        try:
            why = wait_healthy(url, [proc], 300)
            if why:
                print(f"tripod serve {why}")
                return 1
            print(f"healthy in {time.monotonic() - t0:.1f} s")
            r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hello", "max_tokens": 8}, timeout=120)
            print(f"first answer ({r.status_code}) at {time.monotonic() - t0:.1f} s")
        finally:
            proc.terminate()
            proc.wait(60)
    return 0


if __name__ == "__main__":
    if len(sys.argv) < 2:
        print(__doc__)
        sys.exit(2)
    sys.exit(main(sys.argv[1], sys.argv[2:]))
