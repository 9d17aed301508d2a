"""``tripod bench``: measure one or more OpenAI-compatible servers side by side.

    tripod bench --base-url http://127.0.0.1:8000 --concurrency 1,2,4,8 --out bench-out
    tripod bench --launch --base-url http://127.0.0.1:8080,label=llama.cpp --dataset shared-prefix
    tripod bench --base-url URL --request-rate 4 --burstiness 0.5 --num-prompts 200
    tripod bench --base-url URL --dataset trace --trace session.jsonl    # replay a recording
    tripod bench --base-url URL --cost-per-hour 3.2 --machines 2         # + $ per million output tokens
    tripod bench compare DIR1 DIR2 --out compare-out
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tripod.bench import agentic, machine
from tripod.bench.agentic import AGENTIC_SESSIONS
from tripod.bench.client import ENDPOINTS, Target, served_models
from tripod.bench.datasets import DATASETS, TRACE, BenchRequest, make_requests
from tripod.bench.metrics import RequestResult, summarize
from tripod.bench.report import served_text, write_all

log = logging.getLogger("tripod.bench")


class _Stop:
    """Ctrl-C state shared by the signal handler and the level in flight."""

    def __init__(self) -> None:
        self.requested = False
        self.loop: asyncio.AbstractEventLoop | None = None
        self.task: asyncio.Task[Any] | None = None


_STOP = _Stop()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", action="append", default=[], metavar="URL[,label=L][,model=M]",
                   help="a server to measure (repeatable)")
    p.add_argument("--launch", action="store_true", help="also start tripod serve for the run (label 'tripod')")
    p.add_argument("--launch-args", default="", help="extra arguments for the launched tripod serve")
    p.add_argument("--api-key", default=os.environ.get("TRIPOD_API_KEY"),
                   help="the key sent to the servers measured (default: $TRIPOD_API_KEY)")
    p.add_argument("--dataset", default="random", choices=[*DATASETS, AGENTIC_SESSIONS, TRACE],
                   help="generated traffic, or 'trace': replay --trace FILE as recorded")
    p.add_argument("--trace", default=None, metavar="FILE",
                   help="--dataset trace: a JSONL file of recorded requests (per line: offset s, messages or "
                        "prompt, output_tokens, optional session; see tripod/bench/trace.py), each sent at its "
                        "offset with max_tokens = its recorded output length (no warm-up)")
    p.add_argument("--isl", type=int, default=256, help="input length in tokens (random/structured; at most, for copy; suffix for shared-prefix)")
    p.add_argument("--osl", type=int, default=128, help="output length in tokens (copy: at most; the model stops by itself)")
    p.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in [x(1-r), x(1+r)]")
    p.add_argument("--prefix-len", type=int, default=1024, help="shared-prefix: system prompt tokens")
    p.add_argument("--num-groups", type=int, default=4, help="shared-prefix: distinct system prompts")
    p.add_argument("--turns", type=int, default=4, help="agentic: turns per session")
    p.add_argument("--think-time", type=float, default=0.0, help="agentic: mean seconds between turns")
    p.add_argument("--agentic-scale", type=float, default=1.0,
                   help="agentic-sessions: multiply every length (system 2-8k, tool outputs 0.2-4k, answers 50-400)")
    p.add_argument("--agentic-echo", action="store_true",
                   help="agentic-sessions: keep each conversation as tokens (/v1/completions with token ids): every "
                        "later turn sends the previous prompt + the server's own answer (its return_token_ids) + "
                        "the new message, as an agent that extends its conversation exactly (a tripod server)")
    p.add_argument("--write-trace", default=None, metavar="FILE",
                   help="agentic-sessions: also write the measured sessions as a trace (JSONL)")
    p.add_argument("--concurrency", default="1,2,4,8,16,32,64", help="closed loop: comma-separated levels")
    p.add_argument("--prompts-per-concurrency", type=int, default=10, help="closed loop: K x concurrency requests per level")
    p.add_argument("--request-rate", type=float, default=None, help="open loop: requests per second (Poisson)")
    p.add_argument("--burstiness", type=float, default=1.0, help="open loop: gamma shape of arrivals (1 = Poisson)")
    p.add_argument("--num-prompts", type=int, default=100, help="open loop: requests to send")
    p.add_argument("--max-concurrency", type=int, default=None, help="open loop: cap on requests in flight")
    p.add_argument("--warmup", type=int, default=2, help="requests per level before measuring (not counted)")
    p.add_argument("--max-duration", type=float, default=600.0, help="seconds at most per level")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds at most per request")
    p.add_argument("--slo", default=None, help="goodput SLOs, e.g. ttft=2000,tpot=100 (milliseconds)")
    p.add_argument("--machines", type=int, default=1, help="divide throughput by this for the per-machine axis")
    p.add_argument("--cost-per-hour", type=float, default=None, metavar="USD",
                   help="price of one machine per hour: reports cost per million output tokens "
                        "(x --machines machines)")
    p.add_argument("--tokenizer", default=None, help="model whose tokenizer sets lengths (default: the embedded model)")
    p.add_argument("--seed", type=int, default=0, help="seed of the generated datasets (the same seed, the same prompts)")
    p.add_argument("--endpoint", choices=ENDPOINTS, default="auto",
                   help="what to measure: auto (chat or completions, by dataset), responses (/v1/responses "
                        "streams) or embeddings (/v1/embeddings: latency per request, prompt tokens/s)")
    p.add_argument("--out", default="bench-out", help="output folder")


def parse_target(spec: str, api_key: str | None, endpoint: str = "auto") -> Target:
    url, *opts = spec.split(",")
    kv = dict(o.split("=", 1) for o in opts if "=" in o)
    unknown = set(kv) - {"label", "model"}
    if unknown or any("=" not in o for o in opts):
        raise ValueError(f"--base-url {spec!r}: options are label=... and model=...")
    return Target(url.rstrip("/"), kv.get("label") or url, kv.get("model"), api_key, endpoint=endpoint)


def parse_slo(spec: str | None) -> tuple[float | None, float | None]:
    if not spec:
        return None, None
    vals = {}
    for part in spec.split(","):
        k, _, v = part.partition("=")
        if k not in ("ttft", "tpot") or not v:
            raise ValueError(f"--slo {spec!r}: give ttft=MS and/or tpot=MS")
        vals[k] = float(v) / 1000.0
    return vals.get("ttft"), vals.get("tpot")


def compare(dirs: list[str], out: str) -> int:
    """Overlay earlier runs: one curve per (folder, target)."""
    runs: list[dict[str, Any]] = []
    configs = []
    for d in dirs:
        data = json.loads((Path(d) / "results.json").read_text())
        configs.append({"dir": d, **data["config"]})
        name = Path(d).name
        for r in data["runs"]:
            label = name if r["target"] in name else f"{name}:{r['target']}"
            runs.append({**r, "target": label})
    write_all(Path(out), {"compare": configs}, runs)
    agentic.plot_ttft_by_turn(Path(out), runs)  # agentic runs: TTFT by turn, one curve per target
    print(f"wrote {out}/report.html ({len(runs)} runs from {len(dirs)} folders)")
    return 0


@dataclass(slots=True)
class _Plan:
    """What a run measures, checked before anything starts."""

    targets: list[Target]
    levels: list[int]  # closed loop: the concurrency levels ([] for open loop and trace)
    trace: list[BenchRequest] | None  # --dataset trace: the recording
    tok: Any  # the tokenizer that sets generated lengths (None for a trace)
    slo_ttft: float | None
    slo_tpot: float | None


def _plan(args: argparse.Namespace) -> _Plan:
    targets = [parse_target(s, args.api_key, args.endpoint) for s in args.base_url]
    if not targets and not args.launch:
        raise ValueError("give at least one --base-url, or --launch")
    slo_ttft, slo_tpot = parse_slo(args.slo)
    if args.cost_per_hour is not None and not args.cost_per_hour > 0:
        raise ValueError(f"--cost-per-hour must be a price > 0 in USD (got {args.cost_per_hour})")
    if args.machines < 1:
        raise ValueError(f"--machines must be >= 1 (got {args.machines})")
    trace = None
    if args.dataset == TRACE:
        if not args.trace:
            raise ValueError("--dataset trace replays a recording: give it with --trace FILE")
        from tripod.bench.trace import load_trace

        trace = load_trace(args.trace)
    elif args.trace and args.dataset != AGENTIC_SESSIONS:
        raise ValueError("--trace FILE is replayed with --dataset trace (or as sessions: --dataset agentic-sessions)")
    if args.agentic_echo and (args.dataset != AGENTIC_SESSIONS or args.trace or args.write_trace):
        raise ValueError("--agentic-echo generates --dataset agentic-sessions as tokens: drop --trace/--write-trace "
                         "(a trace holds chat messages), or use --dataset agentic-sessions")
    levels = [int(x) for x in args.concurrency.split(",") if x.strip()] if args.request_rate is None else []
    if trace is None and args.request_rate is None and (not levels or min(levels) < 1):
        raise ValueError("--concurrency needs positive integers, e.g. 1,2,4,8")
    tok = None
    if trace is None:
        from tripod.loader import load_tokenizer

        tok = load_tokenizer(args.tokenizer).tokenizer
    return _Plan(targets, levels, trace, tok, slo_ttft, slo_tpot)


def _run_config(args: argparse.Namespace, targets: list[Target]) -> dict[str, Any]:
    """The ``config`` of results.json: the tool, the targets, the machine and every option."""
    return {
        "tool": "tripod bench", "version": _version(), "targets": [
            {"base_url": t.base_url, "label": t.label, "model": t.model, "endpoint": t.endpoint} for t in targets],
        "model": args.tokenizer or "embedded SmolLM2-135M-Instruct", "machine": machine.describe(),
        "options": {k: v for k, v in vars(args).items() if k not in ("api_key", "func")},
        "machines": args.machines, "cost_per_hour": args.cost_per_hour, "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def _on_sigint(signum: int, frame: Any) -> None:
    # NOTE: Ctrl-C must never raise KeyboardInterrupt at an arbitrary point (it once landed in the
    # middle of importing matplotlib, which then could not draw): the first one asks the level in
    # flight to stop and the run to end after writing; a second one is the usual hard stop.
    _STOP.requested = True
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if _STOP.loop is not None and _STOP.task is not None:
        _STOP.loop.call_soon_threadsafe(_STOP.task.cancel)


def _level_requests(args: argparse.Namespace, plan: _Plan,
                    conc: int | None) -> tuple[list[BenchRequest], list[BenchRequest]]:
    """(warm-up, measured) requests of one level."""
    if plan.trace is not None:  # the recording is the workload, cold start included: no warm-up
        return [], plan.trace
    count = conc * args.prompts_per_concurrency if conc else args.num_prompts
    if args.dataset == AGENTIC_SESSIONS:
        return [], _sessions(args, plan, count)
    reqs = make_requests(args.dataset, count + args.warmup, plan.tok, isl=args.isl, osl=args.osl,
                         range_ratio=args.range_ratio, seed=args.seed + (conc or 0), prefix_len=args.prefix_len,
                         num_groups=args.num_groups, turns=args.turns, think_time=args.think_time)
    return reqs[: args.warmup], reqs[args.warmup :]


def _sessions(args: argparse.Namespace, plan: _Plan, count: int) -> list[BenchRequest]:
    """agentic-sessions: a recorded trace replayed as sessions, or ``count`` turns generated (no
    warm-up: a session's first turn is its cold start)."""
    if args.trace:
        return agentic.load_sessions(args.trace)
    reqs = agentic.make_sessions(count, plan.tok, turns=args.turns, think_time=args.think_time, seed=args.seed,
                                 shape=agentic.SessionShape(scale=args.agentic_scale), echo=args.agentic_echo)
    if args.write_trace:
        agentic.write_trace(args.write_trace, reqs)
    return reqs


def _sweep(args: argparse.Namespace, plan: _Plan, config: dict[str, Any], out: Path,
           runs: list[dict[str, Any]]) -> None:
    """Measure every level of every target into ``runs`` (written after each level); raises
    KeyboardInterrupt when a level was interrupted."""
    trace = plan.trace
    for target in plan.targets:
        sweep: list[tuple[int | None, float | None]] = (
            [(None, None)] if trace is not None else [(c, None) for c in plan.levels] or [(None, args.request_rate)])
        for conc, rate in sweep:
            warm, measured = _level_requests(args, plan, conc)
            level, interrupted, spec_decode = _measure(args, target, warm, measured, conc, rate,
                                                       replay=trace is not None)
            summary = summarize(level.results, level.duration, slo_ttft=plan.slo_ttft, slo_tpot=plan.slo_tpot,
                                machines=args.machines, cost_per_hour=args.cost_per_hour)
            mode = "trace" if trace is not None else "closed" if conc else "open"
            runs.append({"target": target.label, "mode": mode, "dataset": args.dataset,
                         "concurrency": conc, "request_rate": rate, **summary})
            if args.dataset == AGENTIC_SESSIONS:
                runs[-1]["agentic"] = agentic.summary(level.results, level.duration, plan.slo_ttft, plan.slo_tpot)
            if spec_decode is not None:  # only servers that count speculative decoding
                runs[-1]["spec_decode"] = spec_decode
            write_all(out, config, runs)  # after every level: an interrupted run keeps what it measured
            _print_row(runs[-1])
            if interrupted or _STOP.requested:
                raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    plan = _plan(args)
    launched = None
    if args.launch:
        launched, url = _launch(args.launch_args)
        plan.targets.insert(0, Target(url, "tripod", None, None, endpoint=args.endpoint))
    out = Path(args.out)
    config = _run_config(args, plan.targets)
    runs: list[dict[str, Any]] = []
    interrupted = False
    previous = signal.signal(signal.SIGINT, _on_sigint)
    try:
        # Inside the try: a Ctrl-C while a target is asked still takes a launched server down.
        record_served(config["targets"], plan.targets)
        print(f"machine: {machine.summary(config['machine'])}", file=sys.stderr)
        for entry in config["targets"]:
            print(f"{entry['label']}: {served_text(entry)}", file=sys.stderr)
        _sweep(args, plan, config, out, runs)
    except KeyboardInterrupt:
        interrupted = True
        print("interrupted: keeping what was measured", file=sys.stderr)
    finally:
        signal.signal(signal.SIGINT, previous)
        if launched is not None:
            launched.send_signal(signal.SIGTERM)
            try:
                launched.wait(60)
            except subprocess.TimeoutExpired:
                launched.kill()
    write_all(out, config, runs)
    agentic.plot_ttft_by_turn(out, runs)
    _print_table(runs)
    print(f"wrote {out}/results.json, results.csv, pareto.png, latency.png, report.html")
    return 130 if interrupted else 0


def record_served(entries: list[dict[str, Any]], targets: list[Target],
                  transport: httpx.AsyncBaseTransport | None = None) -> None:
    """Ask each target once, before measuring, what it serves and how it computes (GET
    /v1/models): ``served`` in its config entry, or None and ``served_error`` saying why."""

    async def ask() -> list[tuple[list[dict[str, Any]] | None, str | None]]:
        async with httpx.AsyncClient(transport=transport) as client:
            return [await served_models(client, t) for t in targets]

    for entry, (models, why) in zip(entries, asyncio.run(ask()), strict=True):
        entry["served"] = models
        if why is not None:
            entry["served_error"] = why


def _measure(args: argparse.Namespace, target: Target, warm: list[Any], measured: list[Any], conc: int | None,
             rate: float | None, replay: bool = False) -> tuple[Any, bool, dict[str, Any] | None]:
    """Run one level: (its results, whether it was interrupted, its speculative-decoding counts
    from the target's /metrics or None)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from tripod.bench import runner, spec

    what = f"{target.label} {_load({'concurrency': conc, 'request_rate': rate, 'mode': 'trace' if replay else ''})}"
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.fields[status]}"), transient=False, disable=not sys.stderr.isatty()) as prog:
        task = prog.add_task(what, total=len(measured), status="")
        failures = [0]

        def done(r: RequestResult) -> None:
            failures[0] += 0 if r.ok else 1
            prog.update(task, advance=1, status=f"{failures[0]} failed" if failures[0] else "")

        spec_decode: list[dict[str, Any] | None] = [None]

        async def go() -> Any:
            if warm:
                w = await runner.closed_loop(target, warm, max(1, min(conc or 1, len(warm))),
                                             max_duration=args.max_duration, timeout=args.timeout)
                if w.interrupted:
                    return runner.Level([], 0.0, interrupted=True)
            async with httpx.AsyncClient() as http:
                before = await spec.scrape(http, target)
            if replay:
                level = await runner.trace_replay(target, measured, max_duration=args.max_duration,
                                                  timeout=args.timeout, on_done=done)
            elif conc:
                level = await runner.closed_loop(target, measured, conc, max_duration=args.max_duration,
                                                 timeout=args.timeout, on_done=done)
            else:
                level = await runner.open_loop(target, measured, rate or 1.0, burstiness=args.burstiness,
                                               max_concurrency=args.max_concurrency, max_duration=args.max_duration,
                                               timeout=args.timeout, seed=args.seed, on_done=done)
            if before is not None and not level.interrupted:
                async with httpx.AsyncClient() as http:
                    spec_decode[0] = spec.summarize_spec(before, await spec.scrape(http, target))
            return level

        main = asyncio.new_event_loop()
        task_ = main.create_task(go())
        _STOP.loop, _STOP.task = main, task_
        if _STOP.requested:
            task_.cancel()
        try:
            level = main.run_until_complete(task_)
            return level, level.interrupted, spec_decode[0]
        except asyncio.CancelledError:
            return runner.Level([], 0.0, interrupted=True), True, None
        finally:
            _STOP.loop = _STOP.task = None
            main.run_until_complete(main.shutdown_asyncgens())  # httpx's stream generators
            main.close()


def _load(r: dict[str, Any]) -> str:
    if r.get("mode") == "trace":
        return "trace"
    return f"C={r['concurrency']}" if r.get("concurrency") else f"rate={r.get('request_rate')}"


def _cost_text(r: dict[str, Any]) -> str:
    c = r.get("cost_per_million_output_tokens")
    return "" if c is None else f", ${c:.3g} per M output tokens"


def _print_row(r: dict[str, Any]) -> None:
    print(f"{r['target']} {_load(r)}: "
          f"{r['completed']} ok, {r['failed']} failed, {r['output_throughput']:.1f} out tok/s{_cost_text(r)}, "
          f"TTFT p50 {r['ttft_ms']['p50']:.0f} ms, TPOT p50 {r['tpot_ms']['p50']:.1f} ms{_spec_text(r)}",
          file=sys.stderr)


def _spec_text(r: dict[str, Any]) -> str:
    sd = r.get("spec_decode")
    if not sd or not sd["draft_tokens"]:
        return ""
    return f", acceptance {100 * sd['acceptance_rate']:.0f}%, mean accepted length {sd['mean_accepted_length']:.2f}"


def _print_table(runs: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="tripod bench")
    cost_col = any(r.get("cost_per_million_output_tokens") is not None for r in runs)
    for c in ("target", "load", "ok/failed", "out tok/s", *(["$/M out tok"] if cost_col else []), "tok/s/user",
              "TTFT p50/p99 ms", "TPOT p50/p99 ms", "goodput req/s", "cached"):
        t.add_column(c)
    spec_cols = any((r.get("spec_decode") or {}).get("draft_tokens") for r in runs)
    if spec_cols:
        t.add_column("spec accept")
        t.add_column("mean acc. len")
    for r in runs:
        cost = r.get("cost_per_million_output_tokens")
        cells = [r["target"], _load(r), f"{r['completed']}/{r['failed']}", f"{r['output_throughput']:.1f}",
                 *([f"{cost:.3g}" if cost is not None else "-"] if cost_col else []), f"{r['interactivity']:.1f}", f"{r['ttft_ms']['p50']:.0f} / {r['ttft_ms']['p99']:.0f}",
                 f"{r['tpot_ms']['p50']:.1f} / {r['tpot_ms']['p99']:.1f}", f"{r['goodput']:.2f}",
                 f"{100 * r['cached_token_share']:.0f}%"]
        if spec_cols:
            sd = r.get("spec_decode") or {}
            has = bool(sd.get("draft_tokens"))
            cells += [f"{100 * sd['acceptance_rate']:.0f}%" if has else "-",
                      f"{sd['mean_accepted_length']:.2f}" if has else "-"]
        t.add_row(*cells)
    Console(stderr=True).print(t)


def _launch(extra: str) -> tuple[subprocess.Popen[bytes], str]:
    from tripod.fleet.process import free_port, spawn_serve, wait_healthy

    port = free_port()
    proc = spawn_serve("127.0.0.1", port, extra.split())
    url = f"http://127.0.0.1:{port}"
    why = wait_healthy(url, [proc], 300)
    if why is not None:
        proc.kill()
        raise ValueError(f"the launched tripod serve {why}")
    return proc, url


def _version() -> str:
    from tripod import __version__

    return __version__
