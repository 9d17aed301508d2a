"""Noisy neighbour inside one engine: tenant A floods the engine with many times its capacity while
tenant B sends a steady trickle; B's time to first token with the scheduler's fair share
(``tripod.engine.fairness``) against B alone, and against the same load without tenants (every
request tenant ""), plus the compute shares of two backlogged tenants at 1:1 and 3:1 weights.

Fair share orders admissions and preempts: with A in every running slot, B's arrival retracts
A's least important request (its KV kept in the prefix cache) and B is admitted at the next step.

The engine is the offline ``Engine`` on the embedded model (no HTTP, no quotas: those are the
server's). Time is counted in engine steps as well as seconds, so the result means the same on a
busy machine.

    .venv/bin/python benchmarks/noisy_neighbour_engine.py --max-running 8 --flood 160 --steady 16
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from tripod import Engine
from tripod.engine.request import Req, SamplingParams

PROMPT_A = "Write a long story about a lighthouse keeper and the sea. " * 4
PROMPT_B = "In one sentence, what is a tide?"


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, round(q * len(ordered)) - 1))]


def run_noisy(engine: Engine, flood: int, steady: int, every: int, tenants: bool) -> dict[str, float]:
    """A's ``flood`` requests at once; one of B's every ``every`` steps; B's TTFT in steps and s."""
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    for i in range(flood):
        engine.add_request(PROMPT_A, params, request_id=f"a{i}", tenant="a" if tenants else "")
    b_reqs: list[Req] = []
    added: dict[str, int] = {}  # B's request → the step it was added at
    waited: dict[str, int] = {}  # B's request → steps to its first token
    step = 0
    while engine.has_work or len(b_reqs) < steady:
        if len(b_reqs) < steady and step % every == 0:
            req = engine.add_request(PROMPT_B, SamplingParams(max_tokens=8, temperature=0.0), request_id=f"b{step}",
                                     tenant="b" if tenants else "")[0]
            b_reqs.append(req)
            added[req.rid] = step
        engine.step()
        step += 1
        for r in b_reqs:
            if r.first_token_time is not None and r.rid not in waited:
                waited[r.rid] = step - added[r.rid]
    ttft_s = [r.first_token_time - r.arrival for r in b_reqs if r.first_token_time is not None]
    return {"b_ttft_p50_s": round(statistics.median(ttft_s), 4), "b_ttft_p99_s": round(_p(ttft_s, 0.99), 4),
            "b_ttft_p99_steps": _p([float(s) for s in waited.values()], 0.99)}


def run_shares(engine: Engine, weights: tuple[float, float], per_tenant: int, steps: int) -> dict[str, float]:
    """Two tenants backlogged with the same requests: the share of tokens each gets over ``steps``."""
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    for i in range(per_tenant):
        for t, w in zip("ab", weights, strict=True):
            engine.add_request(PROMPT_A, params, request_id=f"s{weights}{t}{i}", tenant=t, weight=w)
    got = {"a": 0, "b": 0}
    for _ in range(steps):
        for r in engine.scheduler.running:  # what runs this step, by tenant
            got[r.tenant] += 1
        engine.step()
    for rid in [f"s{weights}{t}{i}" for t in "ab" for i in range(per_tenant)]:
        engine.abort(rid)
    while engine.has_work or engine.pending:
        engine.step()
    share = got["a"] / max(1, got["a"] + got["b"])
    return {"share_a": round(share, 3), "expected_a": round(weights[0] / sum(weights), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-running", type=int, default=8)
    ap.add_argument("--flood", type=int, default=160, help="tenant A's requests, all at once")
    ap.add_argument("--steady", type=int, default=16, help="tenant B's requests, one every --every steps")
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--share-steps", type=int, default=200)
    ap.add_argument("--out", default=None, help="write the results here (JSON)")
    args = ap.parse_args()
    engine = Engine(dtype="float32", max_running=args.max_running, kv_cache_tokens=16384)
    t0 = time.monotonic()
    results = {
        "b_alone": run_noisy(engine, 0, args.steady, args.every, tenants=True),
        "b_with_flood_fair_share": run_noisy(engine, args.flood, args.steady, args.every, tenants=True),
        "b_with_flood_no_tenants": run_noisy(engine, args.flood, args.steady, args.every, tenants=False),
        "shares_1_1": run_shares(engine, (1.0, 1.0), 4 * args.max_running, args.share_steps),
        "shares_3_1": run_shares(engine, (3.0, 1.0), 4 * args.max_running, args.share_steps),
        "args": vars(args), "seconds": round(time.monotonic() - t0, 1),
    }
    text = json.dumps(results, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
