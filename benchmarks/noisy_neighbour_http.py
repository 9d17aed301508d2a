"""Noisy neighbour over HTTP: a real ``tripod serve --tenants`` (the embedded model), tenant A sending
10x the server's capacity, tenant B a steady load well under its share.

Phases (each on the same server unless said):

1. capacity: B-sized requests, closed loop at ``--max-running`` concurrency: C requests/s;
2. B alone: B open loop at ``--b-share`` x C for ``--seconds``: B's TTFT p50/p99, errors;
3. A floods + B: A open loop at ``--flood`` x C (its limit: ``max_concurrent``, by default its
   share of the running slots, max-running / 2; ``--a-max-concurrent`` = max-running lets A alone
   fill every slot), B as in 2: B's TTFT p99 against 2, B's errors, A's answers by status and the
   limits its 429s name;
4. shares: a fresh server per weight pair (1:1, 3:1, tenants without limits), both tenants
   backlogged (closed loop, 2 x max-running each): each tenant's share of the output tokens
   streamed in the measured window, against its weight's share.

Open loop means requests are sent on a fixed schedule whatever the answers do (a 429 costs A
nothing but the refusal). TTFT is the time to the first streamed text. Recorded in
``benchmarks/results/noisy_neighbour.md``.

    .venv/bin/python benchmarks/noisy_neighbour_http.py --max-running 4 --seconds 20 --out /tmp/nn.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_process import ServeProcess

PROMPT_A = "Write a long story about a lighthouse keeper and the sea, with many details. " * 2
PROMPT_B = "In two sentences, what makes a tide rise and fall?"
# --b-words: B's requests are tickets, each its own (a number first: no prefix shared between them
# past the chat template), with this text as the body.
TICKET = ("The customer reports that the night shift scanner at bay four drops every third parcel label, the "
          "handset restarts when the cold chain boxes are logged, and the returns list shows parcels twice. ")
KEYS = {"a": "sk-tenant-a", "b": "sk-tenant-b"}


def tenants_file(path: Path, weights: tuple[float, float], a_limits: dict[str, float]) -> None:
    lines = []
    for (name, key), w in zip(KEYS.items(), weights, strict=True):
        lines += ["[[tenant]]", f'name = "{name}"', f'keys = ["{key}"]', f"weight = {w}"]
        if name == "a":
            lines += [f"{k} = {v}" for k, v in a_limits.items()]
        lines.append("")
    path.write_text("\n".join(lines))


class Server(ServeProcess):
    """``tripod serve --tenants FILE`` on the embedded model."""

    def __init__(self, tmp: Path, tenants: Path, max_running: int, threads: int) -> None:
        super().__init__(tmp, ["--tenants", str(tenants), "--max-running", str(max_running), "--threads", str(threads),
                               "--kv-cache-tokens", "16384", "--max-waiting", "512"])


@dataclass
class Outcome:
    tenant: str
    start: float
    status: int = 0
    ttft: float | None = None
    tokens: list[float] = field(default_factory=list)  # arrival time of each streamed text piece
    error: str | None = None


_SEQ = iter(range(1 << 62))


def b_prompt(words: int) -> str:
    """B's prompt: the short question (``words`` 0, every request the same: a prefix-cache hit after the
    first), or a ticket of about ``words`` words that no other request shares."""
    if not words:
        return PROMPT_B
    body = " ".join((TICKET * (words // len(TICKET.split()) + 1)).split()[:words])
    return f"Ticket {next(_SEQ)}. {body}\nSummarise the ticket in two sentences."


async def one(client: httpx.AsyncClient, url: str, tenant: str, max_tokens: int, b_words: int = 0) -> Outcome:
    prompt = PROMPT_A if tenant == "a" else b_prompt(b_words)
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "stream": True,
            "temperature": 0.0, "ignore_eos": True}
    out = Outcome(tenant, time.monotonic())
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body,
                                 headers={"Authorization": f"Bearer {KEYS[tenant]}"}) as r:
            out.status = r.status_code
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                try:
                    out.error = json.loads(text)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    out.error = text[:200]
                return out
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                if "error" in obj:
                    out.error = str(obj["error"].get("message"))
                    continue
                for ch in obj.get("choices") or []:
                    if (ch.get("delta") or {}).get("content"):
                        now = time.monotonic()
                        if out.ttft is None:
                            out.ttft = now - out.start
                        out.tokens.append(now)
    except httpx.HTTPError as e:
        out.error = f"{type(e).__name__}: {e}"
    return out


async def open_loop(client: httpx.AsyncClient, url: str, tenant: str, rate: float, seconds: float,
                    max_tokens: int, b_words: int = 0) -> list[Outcome]:
    tasks = []
    t0 = time.monotonic()
    n = int(rate * seconds)
    for i in range(n):
        delay = t0 + i / rate - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(client, url, tenant, max_tokens, b_words)))
    return list(await asyncio.gather(*tasks))


async def closed_loop(client: httpx.AsyncClient, url: str, tenant: str, concurrency: int, until: float,
                      max_tokens: int, b_words: int = 0) -> list[Outcome]:
    out: list[Outcome] = []

    async def worker() -> None:
        while time.monotonic() < until:
            out.append(await one(client, url, tenant, max_tokens, b_words))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return out


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[max(0, min(len(s) - 1, round(q * len(s)) - 1))]


def ttft_summary(outs: list[Outcome]) -> dict[str, Any]:
    ttfts = [o.ttft for o in outs if o.ttft is not None]
    errors = [o for o in outs if o.status != 200 or o.error is not None]
    return {"requests": len(outs), "errors": len(errors), "ttft_p50_ms": _ms(pct(ttfts, 0.5)),
            "ttft_p99_ms": _ms(pct(ttfts, 0.99)), "ttft_mean_ms": _ms(statistics.fmean(ttfts) if ttfts else None)}


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1000, 1)


async def noisy(url: str, args: argparse.Namespace) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        await one(client, url, "b", args.max_tokens, args.b_words)  # warm-up
        t_end = time.monotonic() + args.calibrate
        cal = await closed_loop(client, url, "b", args.max_running, t_end, args.max_tokens, args.b_words)
        capacity = len([o for o in cal if o.status == 200]) / args.calibrate
        b_rate = args.b_share * capacity
        alone = await open_loop(client, url, "b", b_rate, args.seconds, args.max_tokens, args.b_words)
        a_task = asyncio.create_task(open_loop(client, url, "a", args.flood * capacity, args.seconds, args.max_tokens))
        await asyncio.sleep(1.0)  # A's flood is on before B's first request
        with_flood = await open_loop(client, url, "b", b_rate, args.seconds - 1.0, args.max_tokens, args.b_words)
        a_outs = await a_task
    statuses: dict[str, int] = {}
    named: dict[str, int] = {}
    for o in a_outs:
        statuses[str(o.status)] = statuses.get(str(o.status), 0) + 1
        if o.status == 429 and o.error:
            for limit in ("max_concurrent", "requests_per_second", "input_tokens_per_minute",
                          "output_tokens_per_minute"):
                if limit in o.error:
                    named[limit] = named.get(limit, 0) + 1
    b_alone, b_flood = ttft_summary(alone), ttft_summary(with_flood)
    ratio = (b_flood["ttft_p99_ms"] / b_alone["ttft_p99_ms"]
             if b_flood["ttft_p99_ms"] and b_alone["ttft_p99_ms"] else None)
    example = next((o.error for o in a_outs if o.status == 429), None)
    return {"capacity_req_s": round(capacity, 2), "b_rate_req_s": round(b_rate, 2),
            "a_rate_req_s": round(args.flood * capacity, 2), "b_alone": b_alone, "b_with_flood": b_flood,
            "b_ttft_p99_ratio": None if ratio is None else round(ratio, 2),
            "a_statuses": statuses, "a_429_limits_named": named, "a_429_example": example,
            "a_answered_req_s": round(statuses.get("200", 0) / args.seconds, 2)}


async def shares(url: str, args: argparse.Namespace, weights: tuple[float, float]) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        await one(client, url, "a", args.max_tokens)
        start = time.monotonic()
        until = start + args.warmup + args.seconds
        outs = await asyncio.gather(*(closed_loop(client, url, t, 2 * args.max_running, until, args.max_tokens)
                                      for t in "ab"))
    lo, hi = start + args.warmup, start + args.warmup + args.seconds
    got = {t: sum(1 for o in outs[i] for x in o.tokens if lo <= x < hi) for i, t in enumerate("ab")}
    total = max(1, got["a"] + got["b"])
    return {"weights": list(weights), "tokens_in_window": got, "share_a": round(got["a"] / total, 3),
            "expected_share_a": round(weights[0] / sum(weights), 3),
            "errors": sum(1 for o in outs[0] + outs[1] if o.status != 200 or o.error)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-running", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--calibrate", type=float, default=10.0, help="seconds of the capacity measurement")
    ap.add_argument("--seconds", type=float, default=20.0, help="seconds of each measured phase")
    ap.add_argument("--warmup", type=float, default=5.0, help="shares: seconds before the window")
    ap.add_argument("--flood", type=float, default=10.0, help="A's rate, in multiples of the capacity")
    ap.add_argument("--b-share", type=float, default=0.25, help="B's rate, as a fraction of the capacity")
    ap.add_argument("--b-words", type=int, default=0,
                    help="B's requests: tickets of about this many words, each its own (default 0: one short "
                    "question, the same every time, so a prefix-cache hit after the first)")
    ap.add_argument("--a-max-concurrent", type=int, default=None,
                    help="tenant A's max_concurrent in the flood (default: max-running / 2, its share)")
    ap.add_argument("--no-shares", action="store_true", help="only the flood (phases 1-3)")
    ap.add_argument("--out", default=None, help="write the results here (JSON)")
    args = ap.parse_args()
    t0 = time.monotonic()
    results: dict[str, Any] = {"args": vars(args)}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        tenants = tmp / "tenants.toml"
        a_max = args.a_max_concurrent or max(1, args.max_running // 2)
        tenants_file(tenants, (1.0, 1.0), {"max_concurrent": a_max})
        srv = Server(tmp, tenants, args.max_running, args.threads)
        try:
            results["noisy"] = asyncio.run(noisy(srv.url, args))
        finally:
            srv.stop()
        for w in () if args.no_shares else ((1.0, 1.0), (3.0, 1.0)):
            tenants_file(tenants, w, {})
            srv = Server(tmp, tenants, args.max_running, args.threads)
            try:
                results[f"shares_{w[0]:g}_{w[1]:g}"] = asyncio.run(shares(srv.url, args, w))
            finally:
                srv.stop()
    results["seconds"] = round(time.monotonic() - t0, 1)
    text = json.dumps(results, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
