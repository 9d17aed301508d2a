"""The one object a server or a router asks about tenants: who is calling (``identify``), may this
request start (``admit``), and the bookkeeping when it ends (``finish``: the limits' lease
released, the per-tenant metrics, the audit line).

A request's :class:`RequestRecord` travels in its ASGI scope (``SCOPE_KEY``) from the middleware
that authenticated it to the route that admits it, and back to the middleware, which finishes it
after the last byte of the answer (streams included).
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from tripod.tenants.audit import AuditLine, AuditLog
from tripod.tenants.limiter import Lease, OverLimit, TenantLimiter
from tripod.tenants.metrics import TenantMetrics
from tripod.tenants.model import Tenant
from tripod.tenants.registry import Identity, TenantRegistry

SCOPE_KEY = "tripod.tenant"
# A router that enforces the token limits itself (fleet-wide) sends a request to a replica with
# this header set to "count" first: the replica answers the request's token counts (what its own
# admission would take: ``TokenCounts``) instead of generating.
COUNT_HEADER = "x-tripod-admission"

# What a process enforces itself (--tenant-limits): every limit; only the token limits and
# max_context (a fleet's replicas: their router enforces the rest); none (attribution only).
ENFORCE_MODES = ("all", "tokens", "none")


@dataclass(frozen=True, slots=True)
class TokenCounts:
    """What a request takes from its tenant's token limits, as the server that would serve it
    counts: its prompt tokens, its output reservation (``max_tokens`` × ``n`` per prompt), and its
    largest prompt + ``max_tokens`` (for ``max_context``)."""

    input_tokens: int
    output_tokens: int
    context_tokens: int

    def as_json(self) -> dict[str, int | str]:
        return {"object": "tripod.admission_count", "input_tokens": self.input_tokens,
                "output_tokens": self.output_tokens, "context_tokens": self.context_tokens}

    @staticmethod
    def from_json(obj: object) -> TokenCounts:
        """``ValueError`` unless ``obj`` is what ``as_json`` wrote."""
        if not isinstance(obj, dict) or obj.get("object") != "tripod.admission_count":
            raise ValueError("not an admission count")
        vals = [obj.get(k) for k in ("input_tokens", "output_tokens", "context_tokens")]
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in vals):
            raise ValueError(f"bad admission count {obj!r}")
        return TokenCounts(*vals)  # type: ignore[arg-type]


def has_token_limits(t: Tenant) -> bool:
    """Whether admitting ``t``'s requests needs their token counts."""
    return t.input_tokens_per_minute is not None or t.output_tokens_per_minute is not None or t.max_context is not None


@dataclass(slots=True)
class RequestRecord:
    """One authenticated request, from its first byte to its last."""

    identity: Identity
    route: str
    start: float = field(default_factory=time.monotonic)
    wall: float = field(default_factory=time.time)
    model: str | None = None
    status: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    first_token: float | None = None  # monotonic; a router: the answer's first byte
    last_token: float | None = None
    token_times: bool = False  # first_token is the first token's own time (a server): TPOT is measured
    lease: Lease | None = None
    prompt: str | None = None
    sync: Callable[[RequestRecord], None] | None = None  # fills the counts in at the end (the server's generation)
    output_known: bool = True  # False: output_tokens is not the answer's count (its reservation is kept)
    probe: bool = False  # a router's count request (COUNT_HEADER): no request of the tenant's, not recorded

    @property
    def tenant(self) -> str:
        return self.identity.tenant.name


def request_keys(headers: dict[bytes, bytes]) -> list[str]:
    """The keys a caller sent: OpenAI's ``Authorization: Bearer KEY`` and/or Anthropic's ``x-api-key``."""
    keys = []
    bearer = headers.get(b"authorization", b"")
    if bearer[:7].lower() == b"bearer " and bearer[7:].strip():
        keys.append(bearer[7:].strip().decode("latin-1"))
    x_key = headers.get(b"x-api-key", b"")
    if x_key:
        keys.append(x_key.decode("latin-1"))
    return keys


def record_of(scope: dict[str, Any]) -> RequestRecord | None:
    rec = scope.get(SCOPE_KEY)
    return rec if isinstance(rec, RequestRecord) else None


class TenantGate:
    """Registry + limiter + metrics + audit for one process. ``enforce``: see ``ENFORCE_MODES``."""

    def __init__(self, registry: TenantRegistry, metrics: TenantMetrics, audit: AuditLog | None = None,
                 enforce: str = "all") -> None:
        assert enforce in ENFORCE_MODES
        self.registry = registry
        self.metrics = metrics
        self.audit = audit
        self.enforce = enforce
        self.limiter = TenantLimiter()
        registry.on_reload.append(lambda ok: metrics.reloads.labels("ok" if ok else "kept").inc())

    def identify(self, headers: dict[bytes, bytes], route: str) -> RequestRecord | None:
        keys = request_keys(headers)
        # NOTE: every key sent is looked up (either header may carry the valid one), the first found wins.
        found = [self.registry.identify(k) for k in keys] if keys else [self.registry.identify(None)]
        ident = next((i for i in found if i is not None), None)
        return RequestRecord(ident, route) if ident is not None else None

    def check_model(self, rec: RequestRecord | None, model: str) -> None:
        """``PermissionError`` when the tenant may not use ``model`` (its ``models`` list)."""
        if rec is not None and not rec.identity.tenant.may_use(model):
            self.metrics.rejections.labels(rec.tenant, "models").inc()
            raise PermissionError(f"tenant {rec.tenant!r} may not use the model {model!r}")

    def check_context(self, rec: RequestRecord | None, tokens: int) -> None:
        """``ValueError`` when prompt + max_tokens passes the tenant's ``max_context`` (400)."""
        t = rec.identity.tenant if rec is not None else None
        if t is None or t.max_context is None or self.enforce == "none" or tokens <= t.max_context:
            return
        self.metrics.rejections.labels(t.name, "max_context").inc()
        raise ValueError(f"the prompt and max_tokens come to {tokens} tokens, more than tenant {t.name!r}'s "
                         f"max_context ({t.max_context}); send a shorter prompt or a smaller max_tokens")

    def early_refusal(self, rec: RequestRecord) -> OverLimit | None:
        """A refusal by the limits that need no counts, before the request is read (counted as a
        rejection), or None: ``admit`` takes the request's place later. Only where every limit is
        enforced here."""
        if self.enforce != "all":
            return None
        e = self.limiter.refusal(rec.identity.tenant)
        if e is not None:
            self.metrics.rejections.labels(rec.tenant, e.limit).inc()
        return e

    def admit(self, rec: RequestRecord | None, input_tokens: int | None = None,
              output_tokens: int | None = None) -> None:
        """Take the request's place in its tenant's limits (released by ``finish``) or raise OverLimit."""
        if rec is None or self.enforce == "none" or rec.lease is not None:
            return
        t = rec.identity.tenant
        if self.enforce == "tokens":
            t = replace(t, requests_per_second=None, max_concurrent=None)
        try:
            rec.lease = self.limiter.admit(t, input_tokens, output_tokens)
        except OverLimit as e:
            self.metrics.rejections.labels(rec.tenant, e.limit).inc()
            raise

    def finish(self, rec: RequestRecord, model: str | None = None) -> None:
        """The request's answer is complete (or the client left): release, count, audit."""
        now = time.monotonic()
        if rec.probe:
            return
        if rec.sync is not None:
            rec.sync(rec)
        if rec.lease is not None:
            self.limiter.release(rec.lease, rec.output_tokens if rec.output_known else None)
        m, name = self.metrics, rec.tenant
        m.requests.labels(name, str(rec.status)).inc()
        if rec.prompt_tokens:
            m.prompt_tokens.labels(name).inc(rec.prompt_tokens)
        if rec.output_tokens:
            m.output_tokens.labels(name).inc(rec.output_tokens)
        if rec.first_token is not None and rec.status < 400:  # (an error's first byte is no token)
            m.ttft.labels(name).observe(rec.first_token - rec.start)
            if rec.token_times and rec.output_tokens > 1:  # the last token: when the answer ended, unless known
                last = rec.last_token if rec.last_token is not None else now
                m.tpot.labels(name).observe((last - rec.first_token) / (rec.output_tokens - 1))
        if self.audit is not None:
            self.audit.write(AuditLine(
                time=datetime.datetime.fromtimestamp(rec.wall, datetime.UTC).isoformat(timespec="milliseconds"),
                tenant=name, key_id=rec.identity.key_id, route=rec.route, model=rec.model or model,
                status=rec.status, prompt_tokens=rec.prompt_tokens, output_tokens=rec.output_tokens,
                latency_s=round(now - rec.start, 4), prompt=rec.prompt))

    def close(self) -> None:
        if self.audit is not None:
            self.audit.close()
