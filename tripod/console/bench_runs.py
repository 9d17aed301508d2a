"""Finding the runs ``tripod bench`` wrote under a directory, and reading each into a ``BenchRun``.

A run is a folder with a ``results.json`` (``{"config": ..., "runs": [...]}``, see
``bench/report.py``). ``tripod bench compare`` folders (their config is ``{"compare": ...}``) are
overlays of other runs, not runs, and are left out. A file that cannot be read is listed with the
reason instead of failing the whole listing.
"""

from __future__ import annotations

import json
import math
import os
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from tripod.console.history import build_history, noise_from_percentiles
from tripod.console.models import BenchIndex, BenchLevel, BenchRun, SkippedRun

MAX_DEPTH = 4
MAX_RUNS = 500


class NotARun(ValueError):
    """A results.json that is not a bench run (say why)."""


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    f = float(v)
    return f if math.isfinite(f) else None


def _int(v: Any) -> int | None:
    return int(v) if isinstance(v, int) and not isinstance(v, bool) else None


def _pct(d: Any, key: str) -> float | None:
    return _num(d.get(key)) if isinstance(d, dict) else None


def _started(config: dict[str, Any], path: Path) -> float:
    text = config.get("started")
    if isinstance(text, str):
        try:
            dt = datetime.fromisoformat(text)
            return dt.timestamp()  # naive: local time, as bench writes it
        except ValueError:
            pass
    return path.stat().st_mtime


def level_from(r: dict[str, Any], dataset: str | None) -> BenchLevel:
    if not isinstance(r.get("target"), str):
        raise NotARun("a run entry has no 'target'")
    completed = _int(r.get("completed")) or 0
    ttft, tpot = r.get("ttft_ms") or {}, r.get("tpot_ms") or {}
    noise = r.get("noise") if isinstance(r.get("noise"), dict) else None
    if noise is not None:
        tput_noise, ttft_noise = _num(noise.get("output_throughput")), _num(noise.get("ttft"))
    else:  # written before bench recorded its noise: estimate it from the percentiles
        tput_noise = noise_from_percentiles(_pct(tpot, "p50"), _pct(tpot, "p90"), completed)
        ttft_noise = noise_from_percentiles(_pct(ttft, "p50"), _pct(ttft, "p90"), completed)
    tput = _num(r.get("output_throughput")) or 0.0
    return BenchLevel(
        target=r["target"], mode=str(r.get("mode") or "closed"),
        dataset=r.get("dataset") if isinstance(r.get("dataset"), str) else dataset,
        concurrency=_int(r.get("concurrency")), request_rate=_num(r.get("request_rate")),
        completed=completed, failed=_int(r.get("failed")) or 0, output_throughput=tput,
        output_throughput_per_machine=_num(r.get("output_throughput_per_machine")) or tput,
        interactivity=_num(r.get("interactivity")), ttft_p50_ms=_pct(ttft, "p50"), ttft_p99_ms=_pct(ttft, "p99"),
        tpot_p50_ms=_pct(tpot, "p50"), cost_per_million_output_tokens=_num(r.get("cost_per_million_output_tokens")),
        output_throughput_rel_noise=tput_noise, ttft_rel_noise=ttft_noise,
    )


def read_run(path: Path, root: Path) -> BenchRun:
    """One results.json → a ``BenchRun`` (``NotARun`` / ``ValueError`` with the reason)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise NotARun(f"cannot read it: {e}") from None
    except ValueError as e:
        raise NotARun(f"not JSON: {e}") from None
    if not isinstance(data, dict) or not isinstance(data.get("runs"), list):
        raise NotARun("no 'runs' list: not written by tripod bench")
    config: dict[str, Any] = data["config"] if isinstance(data.get("config"), dict) else {}
    if "compare" in config:
        raise NotARun("a 'tripod bench compare' overlay, not a run")
    options: dict[str, Any] = config["options"] if isinstance(config.get("options"), dict) else {}
    dataset = options.get("dataset") if isinstance(options.get("dataset"), str) else None
    if dataset == "trace" and isinstance(options.get("trace"), str):
        dataset = f"trace:{Path(options['trace']).name}"
    levels = [level_from(r, dataset) for r in data["runs"] if isinstance(r, dict)]
    for lv in levels:
        if lv.dataset == "trace" and dataset and dataset.startswith("trace:"):
            lv.dataset = dataset  # replays of different trace files are different settings
    started = _started(config, path)
    trace = bool(dataset and dataset.startswith("trace"))
    rel = path.parent.relative_to(root).as_posix()
    return BenchRun(
        id=rel if rel != "." else path.parent.name, started=started,
        started_text=time.strftime("%Y-%m-%d %H:%M", time.localtime(started)),
        model=config.get("model") if isinstance(config.get("model"), str) else None,
        machines=_int(config.get("machines")) or 1, cost_per_hour=_num(config.get("cost_per_hour")),
        targets=list(dict.fromkeys(lv.target for lv in levels)), levels=levels,
        # A trace replays recorded lengths: isl/osl are not its settings.
        isl=None if trace else _int(options.get("isl")), osl=None if trace else _int(options.get("osl")),
    )


def find_results(root: Path) -> list[Path]:
    found: list[Path] = []
    base = len(root.parts)
    for dirpath, dirnames, filenames in os.walk(root):
        depth = len(Path(dirpath).parts) - base
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".")) if depth < MAX_DEPTH else []
        if "results.json" in filenames:
            found.append(Path(dirpath) / "results.json")
        if len(found) >= MAX_RUNS:
            break
    return found


def bench_index(root: str | None) -> BenchIndex:
    """Every run under ``root`` (newest first) and their history."""
    if root is None:
        return BenchIndex(dir=None, runs=[], history=[],
                          message="no benchmark directory: start the server with --bench-dir DIR "
                                  "(the folder tripod bench --out writes into, or a folder of them)")
    path = Path(root)
    if not path.is_dir():
        return BenchIndex(dir=root, runs=[], history=[], message=f"{root} is not a directory")
    runs: list[BenchRun] = []
    skipped: list[SkippedRun] = []
    for f in find_results(path):
        try:
            runs.append(read_run(f, path))
        except ValueError as e:
            skipped.append(SkippedRun(path=f.relative_to(path).as_posix(), why=str(e)))
    runs.sort(key=lambda r: (r.started, r.id), reverse=True)
    message = None if runs else f"no tripod bench results (results.json) under {root}"
    return BenchIndex(dir=root, runs=runs, history=build_history(runs), skipped=skipped, message=message)
