"""The console's per-tenant view (``GET /ui/api/tenants``): each tenant's answers by status, tokens,
rejections by limit, and TTFT/TPOT percentiles, read from the process's per-tenant series
(``tripod.tenants.metrics``: a server's ``tripod:tenant_*``, a router's ``tripod:router_tenant_*``).

Counts and percentiles are since the process started (its cumulative counters and histograms). A
pure function of the metric families, like ``readings``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from typing import Literal

from prometheus_client.metrics_core import Metric

from tripod.console.models import TenantsView, TenantView
from tripod.console.readings import histogram_quantile

_PREFIXES = ("tripod:tenant_", "tripod:router_tenant_")


def _bare(name: str) -> str | None:
    for p in _PREFIXES:
        if name.startswith(p):
            return name[len(p):]
    return None


def _ms(q: float, buckets: dict[float, float]) -> float | None:
    v = histogram_quantile(q, buckets)
    return None if v is None else round(v * 1000.0, 3)


def tenant_views(families: Iterable[Metric], source: Literal["server", "router"]) -> TenantsView:
    by: dict[str, dict[str, object]] = {}
    ttft: dict[str, dict[float, float]] = {}
    tpot: dict[str, dict[float, float]] = {}

    def entry(name: str) -> dict[str, object]:
        return by.setdefault(name, {"by_status": {}, "rejections": {}, "prompt_tokens": 0, "output_tokens": 0})

    for fam in families:
        kind = _bare(fam.name)
        if kind is None or kind == "file_reloads":
            continue
        for s in fam.samples:
            tenant = s.labels.get("tenant")
            value = float(s.value)
            if tenant is None or math.isnan(value) or s.name.endswith("_created"):
                continue
            if kind == "requests" and s.name.endswith("_total"):
                statuses = entry(tenant)["by_status"]
                assert isinstance(statuses, dict)
                status = s.labels.get("status", "?")
                statuses[status] = statuses.get(status, 0) + int(value)
            elif kind == "rejections" and s.name.endswith("_total"):
                limits = entry(tenant)["rejections"]
                assert isinstance(limits, dict)
                limit = s.labels.get("limit", "?")
                limits[limit] = limits.get(limit, 0) + int(value)
            elif kind in ("prompt_tokens", "output_tokens") and s.name.endswith("_total"):
                e = entry(tenant)
                e[kind] = int(e[kind]) + int(value)  # type: ignore[call-overload]
            elif s.name.endswith("_bucket") and kind in ("time_to_first_token_seconds", "time_per_output_token_seconds"):
                hist = (ttft if kind.startswith("time_to_first") else tpot).setdefault(tenant, {})
                le = float(s.labels.get("le", "inf"))
                hist[le] = hist.get(le, 0.0) + value
                entry(tenant)
    views = []
    for name in sorted(by):
        e = by[name]
        statuses: dict[str, int] = e["by_status"]  # type: ignore[assignment]
        views.append(TenantView(
            name=name, requests=sum(statuses.values()), by_status=statuses,
            errors=sum(n for st, n in statuses.items() if not st.startswith("2")),
            prompt_tokens=int(e["prompt_tokens"]), output_tokens=int(e["output_tokens"]),  # type: ignore[call-overload]
            rejections=e["rejections"],  # type: ignore[arg-type]
            ttft_p50_ms=_ms(0.5, ttft.get(name, {})), ttft_p99_ms=_ms(0.99, ttft.get(name, {})),
            tpot_p50_ms=_ms(0.5, tpot.get(name, {})), tpot_p99_ms=_ms(0.99, tpot.get(name, {})),
        ))
    return TenantsView(t=time.time(), source=source, tenants=views)
