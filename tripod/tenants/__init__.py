"""Tenants: who calls (keys → tenants, from ``--tenants FILE``, reloaded live), their limits (429s
that name the limit, with ``Retry-After``), per-tenant metrics, and the audit log. Torch-free: the
server and the router both use it; it imports nothing of theirs."""

from __future__ import annotations

from tripod.tenants.audit import AuditLine, AuditLog
from tripod.tenants.gate import (
    COUNT_HEADER,
    ENFORCE_MODES,
    SCOPE_KEY,
    RequestRecord,
    TenantGate,
    TokenCounts,
    has_token_limits,
    record_of,
    request_keys,
)
from tripod.tenants.limiter import Lease, OverLimit, SlidingWindow, TenantLimiter
from tripod.tenants.metrics import TenantMetrics
from tripod.tenants.model import (
    DEFAULT_TENANT,
    Tenant,
    TenantFile,
    TenantFileError,
    load_tenants,
    parse_tenants,
)
from tripod.tenants.registry import Identity, TenantRegistry

__all__ = [
    "COUNT_HEADER", "DEFAULT_TENANT", "ENFORCE_MODES", "SCOPE_KEY", "AuditLine", "AuditLog", "Identity", "Lease", "OverLimit",
    "RequestRecord", "SlidingWindow", "Tenant", "TenantFile", "TenantFileError", "TenantGate", "TenantLimiter",
    "TenantMetrics", "TenantRegistry", "TokenCounts", "has_token_limits", "load_tenants", "parse_tenants", "record_of", "request_keys",
]
