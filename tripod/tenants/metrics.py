"""Per-tenant Prometheus series, the same on servers (``tripod:tenant_*``) and routers
(``tripod:router_tenant_*``): requests by status, prompt and output tokens, rejections by limit,
time to first token and time per output token, and reloads of the tenants file by result."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 40.0, 80.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)


class TenantMetrics:
    """The series in ``registry`` under ``prefix``."""

    def __init__(self, registry: CollectorRegistry, prefix: str) -> None:
        r = registry
        self.requests = Counter(f"{prefix}requests", "answers by tenant and status", ["tenant", "status"], registry=r)
        self.prompt_tokens = Counter(f"{prefix}prompt_tokens", "prompt tokens served", ["tenant"], registry=r)
        self.output_tokens = Counter(f"{prefix}output_tokens", "tokens generated", ["tenant"], registry=r)
        self.rejections = Counter(f"{prefix}rejections", "requests refused by a tenant limit (429, or 400 for one "
                                  "too large for the limit ever)", ["tenant", "limit"], registry=r)
        self.ttft = Histogram(f"{prefix}time_to_first_token_seconds", "time to first token (the router: to the "
                              "first byte of the answer)", ["tenant"], buckets=_TTFT_BUCKETS, registry=r)
        self.tpot = Histogram(f"{prefix}time_per_output_token_seconds", "mean time between output tokens of a "
                              "request", ["tenant"], buckets=_TPOT_BUCKETS, registry=r)
        self.reloads = Counter(f"{prefix}file_reloads", "reloads of the tenants file by result (ok, kept: invalid, "
                               "the last good file kept)", ["result"], registry=r)
