"""Bench result folders as ``tripod bench`` writes them (``report.write_results_json`` over
``metrics.summarize`` of synthetic request timings), for the console's tests: a run whose speed and
per-request spread are chosen, without a server."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from tripod.bench.metrics import RequestResult, summarize
from tripod.bench.report import write_results_json


def requests(n: int, decode_rate: float, ttft: float, spread: float, output_tokens: int = 32,
             seed: int = 0) -> list[RequestResult]:
    """``n`` requests whose decode rate (tok/s after the first token) and TTFT vary by a relative
    ``spread`` (uniform in ±spread·√3, i.e. a relative sd of ``spread``) around the given means."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        rate = decode_rate * (1 + spread * rng.uniform(-3 ** 0.5, 3 ** 0.5))
        t = ttft * (1 + spread * rng.uniform(-3 ** 0.5, 3 ** 0.5))
        e2e = t + (output_tokens - 1) / rate
        out.append(RequestResult(start=float(i), ttft=t, e2e=e2e, itl=[1 / rate] * (output_tokens - 1),
                                 output_tokens=output_tokens, prompt_tokens=64))
    return out


def write_run(out: Path, started: str, *, decode_rate: float, ttft: float = 0.2, spread: float = 0.05,
              concurrency: int = 4, n: int = 40, target: str = "tripod", isl: int = 64, osl: int = 32,
              dataset: str = "random", cost_per_hour: float | None = None, seed: int = 0,
              levels: list[int] | None = None) -> dict[str, Any]:
    """A run folder with one closed-loop level per concurrency in ``levels`` (default: one level
    at ``concurrency``); a level at concurrency C runs C requests at a time, so its duration is
    n / C × the mean E2E. Returns what was written."""
    runs = []
    for c in levels or [concurrency]:
        rs = requests(n, decode_rate / (1 + 0.1 * (c - 1)), ttft * (1 + 0.05 * (c - 1)), spread, osl, seed + c)
        duration = sum(r.e2e or 0.0 for r in rs) / c
        summary = summarize(rs, duration, cost_per_hour=cost_per_hour)
        runs.append({"target": target, "mode": "closed", "dataset": dataset, "concurrency": c, "request_rate": None,
                     **summary})
    config = {"tool": "tripod bench", "version": "0.1.0", "targets": [{"base_url": "http://127.0.0.1:1", "label": target,
              "model": None}], "model": "embedded SmolLM2-135M-Instruct", "machine": {"cores": 2},
              "options": {"dataset": dataset, "isl": isl, "osl": osl, "concurrency": ",".join(map(str, levels or [concurrency]))},
              "machines": 1, "cost_per_hour": cost_per_hour, "started": started}
    write_results_json(out, config, runs)
    return {"config": config, "runs": runs}
