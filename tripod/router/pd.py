"""The router's side of prefill/decode disaggregation (replicas whose ``/health`` says ``role``).

A new OpenAI chat/completions request goes to the decode replica the policy picks among the
replicas that answer (``Router.serving``); before it is sent there, a prefill replica (the least
busy) is ordered to compute the prompt's KV and hand it to that decode replica
(``server/api/pd.py``), whose answer then finds the prompt cached. Skipped when the decode replica
probably has most of the prompt cached already (fewer than ``pd_min_uncached_tokens`` estimated
uncached tokens: a follow-up turn), for other routes, retries and continuations.

Failures cost time, never a wrong answer: the decode replica only ever loads whole, verified
blocks (``memory/kv_transfer.py``). A prefill replica that fails (dies mid-transfer, is full,
cannot reach the decode replica) is replaced by another one not yet tried, up to
``--max-retries``; when none is left the request goes to the decode replica as it is, which
prefills what it lacks itself (``fallback``). A decode replica that refuses the KV (409: another
model identity: a combination that cannot work) is logged as an error and falls back at once.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

import httpx
import msgspec
from prometheus_client import Counter, Histogram

from tripod.protocol import pd
from tripod.router.core import RouterCore
from tripod.router.policy import Decision, RouteRequest
from tripod.router.replica import Replica

log = logging.getLogger("tripod.router")

_SECONDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
OUTCOMES = ("ok", "retried", "fallback", "refused", "skipped")


class Disaggregator:
    """Owns the hand-over of new prompts to prefill replicas and its counts (``/metrics``, ``/fleet``)."""

    def __init__(self, router: RouterCore) -> None:
        self.router = router
        reg = router.metrics.registry
        self.transfers = Counter(
            "tripod:router_pd_transfers", "prefill hand-overs by outcome: ok, retried (ok on another prefill replica), "
            "fallback (the decode replica prefilled itself), refused (a decode replica refused the KV), skipped "
            "(the decode replica had most of the prompt cached)", ["outcome"], registry=reg)
        self.seconds = Histogram("tripod:router_pd_transfer_seconds",
                                 "a successful hand-over: order to report (prefill + export + transfer)",
                                 buckets=_SECONDS, registry=reg)
        self.kv_bytes = Counter("tripod:router_pd_kv_bytes", "KV bytes handed over to decode replicas", registry=reg)
        self.totals: dict[str, float] = dict.fromkeys(
            (*OUTCOMES, "seconds", "prefill_seconds", "transfer_seconds", "bytes", "blocks"), 0.0)

    def prefill_replicas(self) -> list[Replica]:
        return [r for r in self.router.routable() if r.role == "prefill"]

    def wants(self, path: str, d: Decision, rr: RouteRequest) -> bool:
        """Whether to hand this request's prefill to a prefill replica before sending it to ``d``."""
        if path not in pd.PD_PATHS or not self.prefill_replicas():
            return False
        uncached = rr.prompt_tokens * (1.0 - d.matched_chars / max(len(rr.text), 1))
        if uncached < self.router.config.pd_min_uncached_tokens:
            self._count("skipped")
            return False
        return True

    async def prefill(self, path: str, raw: bytes, headers: dict[str, str], decode: Replica) -> str:
        """Have a prefill replica compute the prompt's KV and hand it to ``decode`` (tries
        ``--max-retries`` others after a failure; returns having counted the outcome). Returns the
        hand-over's id, for the request's ``pd.TRANSFER_HEADER`` to ``decode``: the decode replica
        then waits for any KV stream of it still being received (one cut by a prefill replica that
        died) before it admits the request, so whatever whole blocks came are used."""
        r = self.router
        transfer_id = uuid.uuid4().hex
        order = pd.encode(pd.PrefillOrder(path=path, body=msgspec.Raw(raw), decode_url=decode.url,
                                          transfer_id=transfer_id))
        tried: set[Replica] = set()
        while len(tried) <= r.config.max_retries:
            cands = [p for p in self.prefill_replicas() if p not in tried]
            if not cands:
                break
            rep = min(cands, key=lambda p: (p.inflight, r.rng.random()))
            tried.add(rep)
            outcome = await self._one(rep, order, headers, decode)
            if outcome == "ok":
                self._count("ok" if len(tried) == 1 else "retried")
                return transfer_id
            if outcome in ("refused", "skipped"):
                self._count(outcome)
                return transfer_id
        self._count("fallback")
        log.info("no prefill replica handed over this prompt (%d tried); %s prefills it itself", len(tried),
                 decode.name)
        return transfer_id

    async def _one(self, rep: Replica, order: bytes, headers: dict[str, str], decode: Replica) -> str:
        """One order to one prefill replica: "ok", "failed" (try another), "refused" (do not: the
        replicas cannot hand over to each other) or "skipped" (nothing to hand over: a LoRA adapter's
        prompt, 422)."""
        r = self.router
        assert r.client is not None
        rep.inflight += 1
        rep.routed += 1
        t0 = time.perf_counter()
        try:
            resp = await r.client.post(rep.url + pd.PREFILL_PATH, content=order,
                                       headers={**headers, "content-type": "application/json"})
        except httpx.HTTPError as e:
            rep.failures += 1
            r.record_failure(rep, f"prefill: {type(e).__name__}", fatal=isinstance(e, httpx.ConnectError))
            log.warning("prefill on %s failed (%s: %s)", rep.name, type(e).__name__, e)
            return "failed"
        finally:
            rep.inflight -= 1
            if rep.draining and not rep.inflight:
                r.notify()
        if resp.status_code == 422:
            return "skipped"
        if resp.status_code == 409:
            log.error("prefill on %s for %s refused: %s", rep.name, decode.name, resp.text[:500])
            return "refused"
        if resp.status_code != 200:
            log.warning("prefill on %s answered %d: %s", rep.name, resp.status_code, resp.text[:300])
            if resp.status_code == 503:
                r.record_failure(rep, "prefill answered 503", fatal=True)
            return "failed"
        try:
            done = pd.decode_done(resp.content)
        except (msgspec.ValidationError, msgspec.DecodeError):
            return "failed"
        seconds = time.perf_counter() - t0
        self.seconds.observe(seconds)
        self.kv_bytes.inc(done.bytes)
        t = self.totals
        t["seconds"] += seconds
        t["prefill_seconds"] += done.prefill_seconds
        t["transfer_seconds"] += done.export_seconds + done.transfer_seconds
        t["bytes"] += done.bytes
        t["blocks"] += done.accepted
        return "ok"

    def _count(self, outcome: str) -> None:
        self.transfers.labels(outcome).inc()
        self.totals[outcome] += 1

    def describe(self) -> dict[str, Any]:
        """The hand-overs so far (``/fleet``'s ``pd``)."""
        return {"prefill_replicas": [p.name for p in self.prefill_replicas()],
                **{k: round(v, 4) for k, v in self.totals.items()}}
