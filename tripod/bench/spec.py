"""Speculative decoding as the server counts it: ``/metrics`` scraped before and after a level.

tripod and vLLM expose the same three counters (``tripod:`` / ``vllm:`` prefix):
``spec_decode_num_drafts_total`` (verification rounds that carried a draft),
``spec_decode_num_draft_tokens_total`` and ``spec_decode_num_accepted_tokens_total``; tripod adds a
``proposer`` label. From their increase over a level:

- acceptance rate = accepted tokens / draft tokens
- mean accepted length = 1 + accepted tokens / drafts  (tokens per verification round, the one
  the target samples included; vLLM's definition)

A server that exposes none of them gets no ``spec_decode`` entry in the report.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

import httpx

from tripod.bench.client import Target

FIELDS = ("drafts", "draft_tokens", "accepted_tokens")
# NOTE: ``_total`` right after the field name: vLLM's ``..._accepted_tokens_per_pos_total`` (one
# series per draft position) must not be summed into the accepted tokens.
_SAMPLE = re.compile(
    r"^(?:tripod|vllm):spec_decode_num_(drafts|draft_tokens|accepted_tokens)_total(\{[^}]*\})?\s+(\S+)"
)
_FAMILY = re.compile(r"^# TYPE (?:tripod|vllm):spec_decode_num_drafts(?:_total)? counter", re.M)
_PROPOSER = re.compile(r'proposer="([^"]*)"')

Counts = dict[str, dict[str, float]]  # proposer → {field: cumulative value}


def parse_metrics(text: str) -> Counts | None:
    """The spec-decode counters in a Prometheus text page, per proposer (vLLM's, which have no
    proposer label, under ``"all"``); None when the page has none of them."""
    counts: Counts = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m is None:
            continue
        field, labels, value = m.groups()
        p = _PROPOSER.search(labels or "")
        per = counts.setdefault(p.group(1) if p else "all", dict.fromkeys(FIELDS, 0.0))
        per[field] += float(value)  # other labels (a vLLM engine index) add up
    if not counts and _FAMILY.search(text) is None:
        return None
    return counts


# tripod's server sees the engine's counters in its heartbeat (every 0.5 s): wait for one so that
# the level's last tokens (and none of the warm-up's) land on the right side of the scrape.
SETTLE_S = 1.0


async def scrape(client: httpx.AsyncClient, target: Target, settle: float = SETTLE_S) -> Counts | None:
    """The target's counters once settled; None if it does not expose them (or has no /metrics)."""
    await asyncio.sleep(settle)
    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    try:
        r = await client.get(target.base_url.rstrip("/") + "/metrics", headers=headers, timeout=10)
    except httpx.HTTPError:
        return None
    return parse_metrics(r.text) if r.status_code == 200 else None


def _rates(drafts: float, draft_tokens: float, accepted: float) -> dict[str, Any]:
    return {
        "drafts": int(drafts), "draft_tokens": int(draft_tokens), "accepted_tokens": int(accepted),
        # None, not NaN: results.json stays strict JSON when nothing was drafted.
        "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
        "mean_accepted_length": 1.0 + accepted / drafts if drafts else None,
    }


def summarize_spec(before: Counts | None, after: Counts | None) -> dict[str, Any] | None:
    """The level's increase: totals over every proposer, and ``by_proposer``; None if the server
    exposes no counters."""
    if before is None or after is None:
        return None
    zero = dict.fromkeys(FIELDS, 0.0)
    by: dict[str, dict[str, Any]] = {}
    for proposer, now in sorted(after.items()):
        was = before.get(proposer, zero)
        delta = [now[f] - was[f] for f in FIELDS]
        if any(delta):
            by[proposer] = _rates(*delta)
    total = [sum(b[f] for b in by.values()) for f in FIELDS]
    return {**_rates(*total), "by_proposer": by}
