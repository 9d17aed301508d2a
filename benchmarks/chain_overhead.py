"""The latency a chain adds per hop, over a direct call.

A chain of four trivial chainlets, Hop1 → Hop2 → Hop3 → Hop4: ``run(x, depth)`` answers ``x + 1``
itself at ``depth`` 0 and otherwise asks the next one (so one served chain measures every depth).
The per-hop overhead is the slope of the call's latency against ``depth``:

- ``run_local``: everything in this process; a hop is the handle (validation of the arguments and
  the answer, JSON-shaped data, retries' bookkeeping, metrics) and nothing else;
- ``tripod chains serve`` (local processes): a hop is an HTTP call from one chainlet's process to
  the next one's, with the same boundary. Measured against a direct call: one HTTP POST from the
  benchmark to a bare Starlette app on the same uvicorn and httpx stack, doing the same ``x + 1``.

Sequential calls (one in flight), after a warm-up; medians, means and p99 in milliseconds.

    .venv/bin/python benchmarks/chain_overhead.py [--calls 2000] [--out benchmarks/results/chain_overhead.md]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from tripod import chains

DEPTHS = (0, 1, 2, 3)


class Hop4(chains.Chainlet):
    async def run(self, x: int, depth: int = 0) -> int:
        return x + 1


class Hop3(chains.Chainlet):
    def __init__(self, nxt=chains.depends(Hop4)):
        self.nxt = nxt

    async def run(self, x: int, depth: int = 0) -> int:
        return x + 1 if depth <= 0 else await self.nxt.run(x=x, depth=depth - 1)


class Hop2(chains.Chainlet):
    def __init__(self, nxt=chains.depends(Hop3)):
        self.nxt = nxt

    async def run(self, x: int, depth: int = 0) -> int:
        return x + 1 if depth <= 0 else await self.nxt.run(x=x, depth=depth - 1)


@chains.entrypoint
class Hop1(chains.Chainlet):
    def __init__(self, nxt=chains.depends(Hop2)):
        self.nxt = nxt

    async def run(self, x: int, depth: int = 0) -> int:
        return x + 1 if depth <= 0 else await self.nxt.run(x=x, depth=depth - 1)


# ----------------------------------------------------------------------------- measuring
def _stats(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    return {"p50_ms": statistics.median(s) * 1e3, "mean_ms": statistics.fmean(s) * 1e3,
            "p99_ms": s[min(len(s) - 1, int(0.99 * len(s)))] * 1e3}


def _slope(points: dict[int, float]) -> float:
    xs, ys = list(points), list(points.values())
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)


async def bench_local(calls: int) -> dict[int, dict[str, float]]:
    out = {}
    async with chains.run_local() as chain:
        h = chain.handle(Hop1)
        direct = Hop4()
        samples = []
        for i in range(calls // 10 + calls):
            t = time.perf_counter()
            await direct.run(x=i, depth=0)
            samples.append(time.perf_counter() - t)
        out[-1] = _stats(samples[calls // 10:])
        for d in DEPTHS:
            samples = []
            for i in range(calls // 10 + calls):
                t = time.perf_counter()
                assert await h.run(x=i, depth=d) == i + 1
                samples.append(time.perf_counter() - t)
            out[d] = _stats(samples[calls // 10:])
    return out


async def _http(url: str, body: dict[str, Any], calls: int, check: Any) -> dict[str, float]:
    async with httpx.AsyncClient(timeout=30) as c:
        samples = []
        for i in range(calls // 10 + calls):
            t = time.perf_counter()
            r = await c.post(url, json={**body, "x": i})
            samples.append(time.perf_counter() - t)
            assert r.status_code == 200 and check(r.json(), i), r.text
    return _stats(samples[calls // 10:])


# A bare hop: the same HTTP stack (uvicorn/h11 serving, httpx calling), no chain: it answers x + 1, or
# forwards the call to the next bare app while depth > 0 and passes its answer back unread.
_BARE = """
import json, sys, httpx, uvicorn
from starlette.applications import Starlette
from starlette.responses import Response
from starlette.routing import Route
nxt = sys.argv[2] if len(sys.argv) > 2 else None
client = []
async def run(request):
    body = json.loads(await request.body())
    if nxt and body.get("depth", 0) > 0:
        client or client.append(httpx.AsyncClient())
        r = await client[0].post(nxt, json={"x": body["x"], "depth": body["depth"] - 1})
        return Response(r.content, media_type="application/json")
    return Response(json.dumps(body["x"] + 1), media_type="application/json")
uvicorn.run(Starlette(routes=[Route("/run", run, methods=["POST"])]), port=int(sys.argv[1]), log_level="warning",
            access_log=False)
"""


def _wait(url: str, proc: subprocess.Popen[bytes], path: str) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"exited with {proc.returncode}"
        try:
            if httpx.get(url + path, timeout=1).status_code in (200, 405):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not come up")


def bench_served(calls: int) -> tuple[dict[int, dict[str, float]], dict[int, dict[str, float]]]:
    """(bare HTTP forwarding by depth, the served chain by depth)."""
    from tripod.fleet.process import free_port

    ports = [free_port() for _ in DEPTHS]
    bare = []
    for i in reversed(range(len(ports))):  # the last first: each forwards to the next
        nxt = [f"http://127.0.0.1:{ports[i + 1]}/run"] if i + 1 < len(ports) else []
        bare.append(subprocess.Popen([sys.executable, "-c", _BARE, str(ports[i]), *nxt]))
    chain_port = free_port()
    chain = subprocess.Popen([sys.executable, "-m", "tripod.cli", "--log-level", "WARNING", "chains", "serve",
                              __file__, "--port", str(chain_port)], stderr=subprocess.DEVNULL)
    check = lambda v, i: v == i + 1  # noqa: E731
    try:
        for port, p in zip(reversed(ports), bare, strict=True):
            _wait(f"http://127.0.0.1:{port}", p, "/run")
        _wait(f"http://127.0.0.1:{chain_port}", chain, "/health")
        direct = {d: asyncio.run(_http(f"http://127.0.0.1:{ports[0]}/run", {"depth": d}, calls, check))
                  for d in DEPTHS}
        served = {d: asyncio.run(_http(f"http://127.0.0.1:{chain_port}/run", {"depth": d}, calls, check))
                  for d in DEPTHS}
    finally:
        for p in (*bare, chain):
            p.send_signal(signal.SIGTERM)
            p.wait(60)
    return direct, served


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=2000, help="calls per depth (after a 10%% warm-up)")
    ap.add_argument("--out", default=None, help="write the markdown table here")
    args = ap.parse_args()
    local = asyncio.run(bench_local(args.calls))
    direct, served = bench_served(args.calls)
    local_hop = _slope({d: local[d]["p50_ms"] for d in DEPTHS})
    served_hop = _slope({d: served[d]["p50_ms"] for d in DEPTHS})
    served_hop_mean = _slope({d: served[d]["mean_ms"] for d in DEPTHS})
    bare_hop = _slope({d: direct[d]["p50_ms"] for d in DEPTHS})
    lines = [
        "# Chains: the latency a chain adds per hop",
        "",
        f"`benchmarks/chain_overhead.py --calls {args.calls}` on {platform.machine()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}, {time.strftime('%Y-%m-%d')}; sequential calls, one in flight.",
        "",
        "Chain Hop1 → Hop2 → Hop3 → Hop4 of trivial chainlets (`x + 1`); `depth` = how many hops a call "
        "goes down past the entrypoint. Per-hop overhead = slope of the median latency against depth.",
        "",
        "| | depth 0 | depth 1 | depth 2 | depth 3 | **per hop** |",
        "|---|---|---|---|---|---|",
        "| `run_local`, p50 (ms) | " + " | ".join(f"{local[d]['p50_ms']:.4f}" for d in DEPTHS)
        + f" | **{local_hop * 1e3:.1f} µs** |",
        "| served (local processes), p50 (ms) | " + " | ".join(f"{served[d]['p50_ms']:.3f}" for d in DEPTHS)
        + f" | **{served_hop:.3f} ms** |",
        "| served, mean (ms) | " + " | ".join(f"{served[d]['mean_ms']:.3f}" for d in DEPTHS)
        + f" | {served_hop_mean:.3f} ms |",
        "| served, p99 (ms) | " + " | ".join(f"{served[d]['p99_ms']:.3f}" for d in DEPTHS) + " | |",
        "| bare HTTP forwarding, p50 (ms) | " + " | ".join(f"{direct[d]['p50_ms']:.3f}" for d in DEPTHS)
        + f" | {bare_hop:.3f} ms |",
        "",
        "Direct calls, for comparison: a Python call of a chainlet's `run` "
        f"{local[-1]['p50_ms'] * 1e3:.2f} µs (p50); one HTTP POST to a bare Starlette app on the same stack "
        f"(uvicorn/h11 serving, httpx calling) {direct[0]['p50_ms']:.3f} ms p50. The last row is a chain of such "
        "bare apps, each forwarding the call to the next one (no validation, no metrics, no retries): the cost of "
        "the transport alone.",
        "",
        f"**Per hop**: `run_local` adds {local_hop * 1e3:.1f} µs (validation of arguments and answer, JSON-shaped "
        f"data, metrics); served, a hop adds {served_hop:.2f} ms p50 (target < 2 ms), of which bare HTTP "
        f"forwarding between two processes on this machine costs {bare_hop:.2f} ms; the chain's own work is "
        f"{served_hop - bare_hop:+.2f} ms per hop. Depth 0, served, is already two hops (client → chain server "
        f"→ Hop1): {served[0]['p50_ms']:.2f} ms.",
        "",
        "```json",
        json.dumps({"local": local, "bare_http": direct, "served": served,
                    "per_hop_ms": {"local": local_hop, "served_p50": served_hop, "served_mean": served_hop_mean,
                                   "bare_http_p50": bare_hop}},
                   indent=1),
        "```",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
