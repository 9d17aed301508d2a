"""Write a benchmark's results: results.json, results.csv, plots and report.html."""

from __future__ import annotations

import csv
import html
import json
import math
from pathlib import Path
from typing import Any

from tripod.bench.machine import summary

LATENCIES = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")
SPEC_KEYS = ("drafts", "draft_tokens", "accepted_tokens", "acceptance_rate", "mean_accepted_length")
CSV_FIELDS = [
    "target", "mode", "dataset", "concurrency", "request_rate", "completed", "failed", "duration_s",
    "input_tokens", "output_tokens", "request_throughput", "input_throughput", "output_throughput",
    "output_throughput_per_machine", "total_throughput", "cost_per_million_output_tokens", "interactivity", "goodput",
    "cached_token_share",
    *[f"{m}_{s}" for m in LATENCIES for s in ("mean", "p50", "p90", "p95", "p99")],
    # From the server's /metrics (bench/spec.py); empty for servers that do not count them.
    *[f"spec_{k}" for k in SPEC_KEYS],
    # The level's own spread (relative standard errors; bench/metrics.py), for comparing runs.
    "noise_output_throughput", "noise_ttft",
]


def write_results_json(out: Path, config: dict[str, Any], runs: list[dict[str, Any]]) -> None:
    """results.json: the run's config and every level's summary (what the console reads)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"config": config, "runs": runs}, indent=2, default=_json_default))


def write_all(out: Path, config: dict[str, Any], runs: list[dict[str, Any]]) -> None:
    write_results_json(out, config, runs)
    with open(out / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in runs:
            row = dict(r)
            for m in LATENCIES:
                for s, v in (r.get(m) or {}).items():
                    row[f"{m}_{s}"] = v
            for k in SPEC_KEYS:
                row[f"spec_{k}"] = (r.get("spec_decode") or {}).get(k)
            for k in ("output_throughput", "ttft"):
                row[f"noise_{k}"] = (r.get("noise") or {}).get(k)
            w.writerow(row)
    curves: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        curves.setdefault(r["target"], []).append(r)
    plot_pareto(out / "pareto.png", curves, config.get("machines", 1))
    plot_latency(out / "latency.png", curves)
    write_html(out / "report.html", config, runs)


def _json_default(x: Any) -> Any:
    if isinstance(x, float) and math.isnan(x):
        return None
    raise TypeError(type(x).__name__)


def _x(run: dict[str, Any]) -> float:
    return float(run.get("interactivity") or math.nan)


def plot_pareto(path: Path, curves: dict[str, list[dict[str, Any]]], machines: int = 1) -> None:
    """Throughput per machine vs interactivity (tok/s/user), one curve per target."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 5))
    for label, runs in curves.items():
        # In order of load, so the line runs from light (right) to heavy (left).
        ordered = sorted(runs, key=lambda r: r.get("concurrency") or r.get("request_rate") or 0)
        pts = [(_x(r), r["output_throughput_per_machine"], r.get("concurrency")) for r in ordered
               if not math.isnan(_x(r))]
        if not pts:
            continue
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        for x, y, c in pts:
            if c is not None:
                ax.annotate(f"C={c}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xlabel("interactivity (tok/s per user = 1 / median TPOT)")
    ax.set_ylabel(f"output throughput per machine (tok/s){'' if machines == 1 else f', {machines} machines'}")
    ax.set_title("throughput vs interactivity")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_latency(path: Path, curves: dict[str, list[dict[str, Any]]]) -> None:
    """TTFT and TPOT percentiles against load, one line per target and percentile."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, metric in zip(axes, ("ttft_ms", "tpot_ms"), strict=True):
        for label, runs in curves.items():
            runs = sorted(runs, key=lambda r: r.get("concurrency") or r.get("request_rate") or 0)
            xs = [r.get("concurrency") or r.get("request_rate") or 1 for r in runs]  # a trace replay: one point
            for p, style in (("p50", "-"), ("p99", "--")):
                ax.plot(xs, [(r.get(metric) or {}).get(p) for r in runs], style, marker=".", label=f"{label} {p}")
        ax.set_xlabel("concurrency (or request rate)")
        ax.set_ylabel(metric.replace("_ms", " (ms)"))
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_html(path: Path, config: dict[str, Any], runs: list[dict[str, Any]]) -> None:
    cols = ["target", "mode", "concurrency", "request_rate", "completed", "failed", "output_throughput", "interactivity",
            "goodput", "cached_token_share"]
    if any(r.get("cost_per_million_output_tokens") is not None for r in runs):
        cols.insert(cols.index("output_throughput") + 1, "cost_per_million_output_tokens")
    spec_cols = ["acceptance_rate", "mean_accepted_length"] if any(r.get("spec_decode") for r in runs) else []
    head = "".join(f"<th>{c}</th>" for c in [*cols, "TTFT p50/p99 ms", "TPOT p50/p99 ms", "E2E p50/p99 ms",
                                             *[f"spec {c}" for c in spec_cols]])
    body = []
    for r in runs:
        cells = [_fmt(r.get(c)) for c in cols]
        for m in ("ttft_ms", "tpot_ms", "e2e_ms"):
            d = r.get(m) or {}
            cells.append(f"{_fmt(d.get('p50'))} / {_fmt(d.get('p99'))}")
        cells += [_fmt((r.get("spec_decode") or {}).get(c)) for c in spec_cols]
        body.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    path.write_text(f"""<!doctype html><html><head><meta charset="utf-8"><title>tripod bench</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}td,th{{border:1px solid #ccc;padding:4px 8px;font-size:13px}}</style>
</head><body><h1>tripod bench</h1>
<p>Formulas: TPOT = (E2E − TTFT)/(output tokens − 1); interactivity = 1/median TPOT; goodput = requests
meeting the SLOs per second; throughput = tokens / run duration; cost per million output tokens = cost per
machine-hour × machines / (output tok/s × 3600) × 10⁶. Config: <code>{html.escape(json.dumps(config, default=str))}</code></p>
<h2>Machine</h2>{_machine_html(config)}
<h2>Throughput vs interactivity</h2><img src="pareto.png" alt="pareto">
<h2>Latency percentiles</h2><img src="latency.png" alt="latency">
<h2>Runs</h2><table><tr>{head}</tr>{''.join(body)}</table>
<p>Raw data: <a href="results.json">results.json</a>, <a href="results.csv">results.csv</a>.</p>
</body></html>
""")


def compute_text(model: dict[str, Any]) -> str:
    """How a server said it computes one model (client.MODEL_FIELDS): "cpu avx2, bfloat16, Q4_1"
    from tripod, "reference (no kernels for this CPU), float32", "owned by llamacpp" from a peer."""
    c = model.get("compute")
    parts = []
    if isinstance(c, dict):
        path = " ".join(str(c[k]) for k in ("backend", "isa") if c.get(k)) or "compute"
        parts.append(f"{path} ({c['reason']})" if c.get("reason") else path)
    elif c is not None:
        parts.append(str(c))
    parts += [str(model[k]) for k in ("dtype", "quantization") if model.get(k)]
    if model.get("weights"):
        parts.append(f"weights {model['weights']}")
    if model.get("owned_by") and c is None:
        parts.append(f"owned by {model['owned_by']}")
    return ", ".join(parts) or "no compute path reported"


def served_text(entry: dict[str, Any]) -> str:
    """A bench target's config entry as one line: each model it serves and how it computes it."""
    if "served" not in entry:
        return "not asked (an older record)"
    if entry["served"] is None:
        return f"GET /v1/models failed: {entry.get('served_error')}"
    return "; ".join(f"{m.get('id')}: {compute_text(m)}" for m in entry["served"]) or "no models listed"


def _machine_html(config: dict[str, Any]) -> str:
    """The machine and each target's compute path; a comparison shows every folder's."""
    runs = config.get("compare") or [config]
    out = []
    for c in runs:
        head = f"<b>{html.escape(str(c['dir']))}</b>: " if "dir" in c else ""
        out.append(f"<p>{head}{html.escape(summary(c.get('machine') or {}))}</p><ul>")
        for t in c.get("targets") or []:
            out.append(f"<li>{html.escape(str(t.get('label')))} ({html.escape(str(t.get('base_url')))}): "
                       f"{html.escape(served_text(t))}</li>")
        out.append("</ul>")
    return "".join(out)


def _fmt(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)
