"""Time from starting ``tripod serve`` to a healthy ``/health`` and to the first answer, with a
given cache folder (``TRIPOD_CACHE_DIR``: the kernels' build and the converted tokenizer).

    rm -rf /tmp/cold && .venv/bin/python benchmarks/startup_time.py /tmp/cold   # cold: nothing cached
    .venv/bin/python benchmarks/startup_time.py /tmp/cold                          # warm (after ~30 s)
    .venv/bin/python benchmarks/startup_time.py /tmp/cold --weights stored         # extra serve options
"""

import os
import sys
import time

import httpx

from tripod.serve_process import free_port, spawn_serve, wait_healthy

cache = sys.argv[1]
os.environ["TRIPOD_CACHE_DIR"] = cache
port = free_port(); url = f"http://127.0.0.1:{port}"
t0 = time.monotonic()
log = open(f"{cache}.log", "ab")
p = spawn_serve("127.0.0.1", port, sys.argv[2:], log=log)
why = wait_healthy(url, [p], 300)
t1 = time.monotonic()
print(f"healthy in {t1 - t0:.1f} s", why or "")
# the compute path the engine reports, and when the kernels arrive
r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hello", "max_tokens": 8}, timeout=60)
print("first answer", r.status_code, f"at {time.monotonic() - t0:.1f} s")
p.terminate(); p.wait()
