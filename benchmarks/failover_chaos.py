"""Chaos run of the router's mid-answer failover (loopback only, bounded).

A fleet of ``--replicas`` (``tripod serve --replicas N``, fp32, the embedded model) under steady
streaming load: ``--concurrency`` clients stream greedy chat answers (the official ``openai``
client) for ``--duration`` seconds, while a killer SIGKILLs a random replica's server process or
its engine process every ``--kill-every`` seconds (only while at least two replicas are healthy, so
there is somewhere to continue; the supervisor restarts the dead ones). Every answer is compared
with its undisturbed reference, taken from the same fleet before the chaos starts.

Reported: requests, kills (server / engine), continuations (the router's
``tripod:router_continuations_total`` by outcome), errors, mismatches, and latency: end to end for
requests a kill hit (their replica was killed while they streamed) against the others, the added
latency of the hit ones (their latency minus the median of the unhit ones of the same prompt),
and the router's failure → continued-first-byte time (``tripod:router_continuation_seconds``).

    python benchmarks/failover_chaos.py --duration 180 --out benchmarks/results/failover_chaos.md

``run()`` is what ``tests/router/test_failover_chaos.py`` (slow) calls.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families
from speculative import machine  # benchmarks/speculative.py (this script's folder is on sys.path)

from tripod.fleet.process import free_port, wait_healthy

REPLICA_ARGS = ["--dtype", "float32", "--kernels", "optimized", "--kv-cache-tokens", "8192", "--threads", "1"]
TOPICS = ["lighthouses", "glaciers", "the printing press", "bees", "tides", "volcanoes", "the violin", "comets",
          "salt", "bridges", "owls", "copper"]


@dataclass
class Result:
    prompt: int
    replica: str
    start: float
    end: float
    ok: bool
    error: str | None = None


@dataclass
class Report:
    started: str
    machine: str
    command: str
    replicas: int
    concurrency: int
    duration_s: float
    kill_every_s: float
    max_tokens: int
    requests: int = 0
    completed: int = 0
    errors: int = 0
    mismatches: int = 0
    kills_server: int = 0
    kills_engine: int = 0
    hit_requests: int = 0  # requests whose replica was killed while they streamed
    continuations: dict[str, float] = field(default_factory=dict)
    latency_unhit_s: dict[str, float] = field(default_factory=dict)
    latency_hit_s: dict[str, float] = field(default_factory=dict)
    added_latency_s: dict[str, float] = field(default_factory=dict)
    router_continuation_s: dict[str, float] = field(default_factory=dict)
    error_samples: list[str] = field(default_factory=list)


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def summary(xs: list[float]) -> dict[str, float]:
    return {"n": len(xs), "p50": pct(xs, 50), "p90": pct(xs, 90), "p99": pct(xs, 99), "max": max(xs, default=float("nan"))}


def metrics(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def histogram_quantiles(m: dict[Any, float], name: str) -> dict[str, float]:
    """p50/p90/p99 upper bounds of a Prometheus histogram (bucket edges)."""
    buckets = sorted((float(dict(labels)["le"]), v) for (n, labels), v in m.items() if n == name + "_bucket")
    total = m.get((name + "_count", ()), 0.0)
    out: dict[str, float] = {"n": total, "mean": m.get((name + "_sum", ()), 0.0) / total if total else float("nan")}
    for q in (50, 90, 99):
        out[f"p{q}<="] = next((le for le, c in buckets if c >= total * q / 100), float("nan")) if total else float("nan")
    return out


class Fleet:
    def __init__(self, replicas: int, log_dir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_dir / "router.log", "wb")
        cmd = [sys.executable, "-m", "tripod.cli", "serve", "--replicas", str(replicas), "--port", str(self.port),
               "--health-interval", "0.2", "--max-retries", "3", "--stall-timeout", "15",
               "--replica-log-dir", str(log_dir), *REPLICA_ARGS]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "HF_HUB_OFFLINE": "1"})
        why = wait_healthy(self.url, [self.proc], 600)
        if why is not None:
            raise SystemExit(f"the fleet {why} (logs in {log_dir})")
        self.wait_healthy(replicas, 600)

    def replicas(self) -> list[dict[str, Any]]:
        return list(httpx.get(self.url + "/fleet", timeout=10).json()["replicas"])

    def wait_healthy(self, n: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while sum(r["state"] == "healthy" for r in self.replicas()) < n:
            if time.monotonic() > deadline:
                raise SystemExit(f"fewer than {n} healthy replicas after {timeout:.0f} s")
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


def request(client: openai.OpenAI, prompt: int, max_tokens: int) -> tuple[str, str, str | None]:
    """One greedy streamed chat: (text, replica that started it, error event if any)."""
    raw = client.chat.completions.with_raw_response.create(
        model="default", messages=[{"role": "user", "content": f"Tell me about {TOPICS[prompt]}, in detail."}],
        max_tokens=max_tokens, temperature=0, stream=True, extra_body={"ignore_eos": True})
    text = []
    try:
        for c in raw.parse():
            if c.choices and c.choices[0].delta.content:
                text.append(c.choices[0].delta.content)
    except openai.APIError as e:
        return "".join(text), raw.headers["x-tripod-replica"], str(e)
    return "".join(text), raw.headers["x-tripod-replica"], None


def run(duration: float = 180.0, replicas: int = 3, concurrency: int = 4, kill_every: float = 15.0,
        max_tokens: int = 64, seed: int = 0, log_dir: Path | None = None, command: str = "") -> Report:
    rng = random.Random(seed)
    tmp = Path(log_dir or tempfile.mkdtemp(prefix="tripod-chaos-"))
    tmp.mkdir(parents=True, exist_ok=True)
    rep = Report(datetime.now(UTC).isoformat(timespec="seconds"), machine(), command, replicas, concurrency,
                 duration, kill_every, max_tokens)
    fleet = Fleet(replicas, tmp)
    try:
        client = openai.OpenAI(base_url=fleet.url + "/v1", api_key="none", max_retries=0, timeout=300)
        refs = {}
        for p in range(len(TOPICS)):  # undisturbed references, from this fleet
            text, _, err = request(client, p, max_tokens)
            assert err is None, err
            refs[p] = text
        before = metrics(fleet.url)
        results: list[Result] = []
        kills: list[tuple[float, str]] = []  # (time, replica name)
        lock = threading.Lock()
        stop_at = time.monotonic() + duration

        def worker(w: int) -> None:
            wr = random.Random(seed * 1000 + w)
            c = openai.OpenAI(base_url=fleet.url + "/v1", api_key="none", max_retries=0, timeout=300)
            while time.monotonic() < stop_at:
                p = wr.randrange(len(TOPICS))
                t0 = time.monotonic()
                try:
                    text, replica, err = request(c, p, max_tokens)
                except openai.APIError as e:
                    text, replica, err = "", "?", f"{type(e).__name__}: {e}"
                ok = err is None and text == refs[p]
                with lock:
                    results.append(Result(p, replica, t0, time.monotonic(), ok, err if err else
                                          (None if ok else f"mismatch on prompt {p}: {text[:80]!r}")))

        def killer() -> None:
            next_kill = time.monotonic() + kill_every
            while time.monotonic() < stop_at - kill_every / 2:
                time.sleep(max(0.0, min(next_kill, stop_at) - time.monotonic()))
                if time.monotonic() >= stop_at:
                    return
                next_kill += kill_every
                healthy = [r for r in fleet.replicas() if r["state"] == "healthy"]
                if len(healthy) < 2:
                    continue  # nowhere to continue: wait for the supervisor's restarts
                victim = rng.choice(healthy)
                try:
                    if rng.random() < 0.5:
                        os.kill(victim["pid"], signal.SIGKILL)
                        rep.kills_server += 1
                    else:
                        engine = httpx.get(victim["url"] + "/health", timeout=5).json()["engine_pid"]
                        os.kill(engine, signal.SIGKILL)
                        rep.kills_engine += 1
                except (OSError, httpx.HTTPError, KeyError):
                    continue
                with lock:
                    kills.append((time.monotonic(), victim["name"]))

        threads = [threading.Thread(target=worker, args=(w,)) for w in range(concurrency)]
        threads.append(threading.Thread(target=killer))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        after = metrics(fleet.url)
    finally:
        fleet.stop()

    rep.requests = len(results)
    rep.completed = sum(r.error is None or r.error.startswith("mismatch") for r in results)
    rep.errors = sum(r.error is not None and not r.error.startswith("mismatch") for r in results)
    rep.mismatches = sum(r.error is not None and r.error.startswith("mismatch") for r in results)
    rep.error_samples = [r.error for r in results if r.error][:10]  # type: ignore[misc]
    for outcome in ("ok", "failed", "exhausted"):
        key = ("tripod:router_continuations_total", (("outcome", outcome),))
        rep.continuations[outcome] = after.get(key, 0.0) - before.get(key, 0.0)
    hit = [r for r in results if any(r.start <= t <= r.end and name == r.replica for t, name in kills)]
    unhit = [r for r in results if r not in hit]
    rep.hit_requests = len(hit)
    rep.latency_hit_s = summary([r.end - r.start for r in hit])
    rep.latency_unhit_s = summary([r.end - r.start for r in unhit])
    base = {p: statistics.median([r.end - r.start for r in unhit if r.prompt == p] or [float("nan")])
            for p in range(len(TOPICS))}
    rep.added_latency_s = summary([r.end - r.start - base[r.prompt] for r in hit if base[r.prompt] == base[r.prompt]])
    rep.router_continuation_s = histogram_quantiles(after, "tripod:router_continuation_seconds")
    return rep


def markdown(r: Report) -> str:
    def row(d: dict[str, float]) -> str:
        return " | ".join(f"{d.get(k, float('nan')):.3g}" for k in ("n", "p50", "p90", "p99", "max"))

    c = r.continuations
    return "\n".join([
        "# Failover chaos run",
        "",
        f"- date: {r.started}",
        f"- machine: {r.machine}",
        f"- command: `{r.command}`",
        f"- fleet: {r.replicas} replicas (`tripod serve --replicas {r.replicas}`, fp32, embedded SmolLM2-135M, "
        f"`--threads 1`, `--max-retries 3`, `--stall-timeout 15`), {r.concurrency} concurrent greedy streams of "
        f"{r.max_tokens} tokens for {r.duration_s:.0f} s, a SIGKILL every {r.kill_every_s:.0f} s (replica server "
        "process or its engine process, at random, while at least 2 replicas are healthy)",
        "",
        "| requests | completed | errors | mismatches vs undisturbed | kills (server / engine) | requests hit by a kill "
        "| continuations ok / failed / exhausted |",
        "|---|---|---|---|---|---|---|",
        f"| {r.requests} | {r.completed} | {r.errors} | {r.mismatches} | {r.kills_server} / {r.kills_engine} "
        f"| {r.hit_requests} | {c.get('ok', 0):.0f} / {c.get('failed', 0):.0f} / {c.get('exhausted', 0):.0f} |",
        "",
        "Latency (seconds, end to end per request):",
        "",
        "| | n | p50 | p90 | p99 | max |",
        "|---|---|---|---|---|---|",
        f"| not hit | {row(r.latency_unhit_s)} |",
        f"| hit by a kill | {row(r.latency_hit_s)} |",
        f"| added (hit minus the median unhit of its prompt) | {row(r.added_latency_s)} |",
        "",
        f"Router, failure → first byte of the continued answer (`tripod:router_continuation_seconds`, bucket "
        f"bounds): n {r.router_continuation_s.get('n', 0):.0f}, mean {r.router_continuation_s.get('mean', 0):.3f} s, "
        f"p50 ≤ {r.router_continuation_s.get('p50<=', 0):g} s, p90 ≤ {r.router_continuation_s.get('p90<=', 0):g} s, "
        f"p99 ≤ {r.router_continuation_s.get('p99<=', 0):g} s.",
        "",
        "Every answer is compared with its undisturbed greedy reference from the same fleet (fp32 on "
        "tripod's kernels: token-identical is the expectation, not a tolerance). The added latency of a hit "
        "request is the time to notice the failure (a cut connection at once; an engine death via its "
        "server's error event), the continuation's prefill of prompt + tokens so far on another replica, and "
        "the competition for the machine's cores from the replica being restarted (it loads the model).",
        "",
        *(["Errors (first 10):", "", *[f"- {e}" for e in r.error_samples], ""] if r.error_samples else []),
    ]) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=180.0)
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--kill-every", type=float, default=15.0)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-dir", default=None)
    ap.add_argument("--out", default=None, help="write the markdown report here (and the JSON beside it)")
    args = ap.parse_args()
    command = "python " + " ".join(["benchmarks/failover_chaos.py", *sys.argv[1:]])
    r = run(args.duration, args.replicas, args.concurrency, args.kill_every, args.max_tokens, args.seed,
            Path(args.log_dir) if args.log_dir else None, command)
    md = markdown(r)
    print(md)
    if args.out:
        Path(args.out).write_text(md)
        Path(args.out).with_suffix(".json").write_text(json.dumps(asdict(r), indent=1) + "\n")


if __name__ == "__main__":
    main()
