"""The tenants file (``--tenants FILE``): its model, and its strict validation with the line at fault.

```toml
[[tenant]]
name = "acme"
keys = ["sk-acme-1"]            # and/or key_sha256 = ["<hex digest>"]
weight = 2.0                    # share under contention (default 1)
requests_per_second = 5         # every limit optional
input_tokens_per_minute = 200000
output_tokens_per_minute = 20000
max_concurrent = 8
max_context = 4096
models = ["SmolLM2-135M-Instruct"]
```

Keys are kept only as SHA-256 digests (a plain key is hashed as the file is read); nothing here
holds or logs a key. Torch-free: the router and the server both read it.
"""

from __future__ import annotations

import hashlib
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_TENANT = "default"  # the tenant of the plain --api-key (and of every request without tenants)

# The limits a tenant may set, by name: the type each must have (int or float, never bool).
RATE_LIMITS = ("requests_per_second",)
TOKEN_LIMITS = ("input_tokens_per_minute", "output_tokens_per_minute")
COUNT_LIMITS = ("max_concurrent", "max_context")
_KNOWN = {"name", "keys", "key_sha256", "weight", "models", *RATE_LIMITS, *TOKEN_LIMITS, *COUNT_LIMITS}
_HEX64 = re.compile(r"[0-9a-f]{64}")


class TenantFileError(ValueError):
    """The file cannot be used: ``str()`` says where (``path:line``) and why."""


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def key_id(key_digest: bytes) -> str:
    """A key's public id in logs and the audit log: a short prefix of its digest, never the key."""
    return key_digest.hex()[:12]


@dataclass(frozen=True, slots=True)
class Tenant:
    """One customer: its weight under contention and its limits (None: no limit)."""

    name: str
    weight: float = 1.0
    requests_per_second: float | None = None
    input_tokens_per_minute: int | None = None
    output_tokens_per_minute: int | None = None
    max_concurrent: int | None = None
    max_context: int | None = None
    models: tuple[str, ...] | None = None

    def may_use(self, model: str) -> bool:
        return self.models is None or model in self.models


@dataclass(frozen=True, slots=True)
class TenantFile:
    """A validated file: the tenants by name and each key digest's tenant name."""

    tenants: dict[str, Tenant]
    keys: tuple[tuple[bytes, str], ...]


class _Lines:
    """Where things are in the file's text, for messages: tomllib gives values, not positions."""

    def __init__(self, text: str) -> None:
        self.lines = text.splitlines()
        self.heads = [i + 1 for i, s in enumerate(self.lines) if re.match(r"\s*\[\[\s*tenant\s*\]\]", s)]

    def of(self, index: int, key: str | None = None) -> int:
        """The line of tenant ``index``'s table, or of its ``key`` inside it."""
        if index >= len(self.heads):
            return 1
        start = self.heads[index]
        if key is not None:
            end = self.heads[index + 1] if index + 1 < len(self.heads) else len(self.lines) + 1
            for n in range(start, end):
                if re.match(rf"\s*{re.escape(key)}\s*=", self.lines[n - 1]):
                    return n
        return start


def load_tenants(path: str | Path) -> TenantFile:
    """Read and validate ``path``; a :class:`TenantFileError` names the line and the reason."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise TenantFileError(f"{p}: cannot read the tenants file ({e.strerror})") from None
    return parse_tenants(text, str(p))


def parse_tenants(text: str, where: str = "<tenants>") -> TenantFile:
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        m = re.search(r"line (\d+)", str(e))
        line = int(m.group(1)) if m else (max(1, len(text.splitlines())) if "end of document" in str(e) else 1)
        raise TenantFileError(f"{where}:{line}: not valid TOML ({e})") from None
    lines = _Lines(text)
    extra = set(doc) - {"tenant"}
    if extra:
        raise TenantFileError(f"{where}:1: unknown top-level key(s) {', '.join(sorted(extra))}; "
                              "the file holds only [[tenant]] tables")
    tables = doc.get("tenant", [])
    if not isinstance(tables, list):
        raise TenantFileError(f"{where}:1: 'tenant' must be an array of tables: write [[tenant]]")
    tenants: dict[str, Tenant] = {}
    owner: dict[bytes, str] = {}
    for i, table in enumerate(tables):
        def fail(msg: str, key: str | None = None, i: int = i) -> TenantFileError:
            return TenantFileError(f"{where}:{lines.of(i, key)}: {msg}")

        tenant, digests = _tenant(table, fail)
        if tenant.name in tenants:
            raise fail(f"tenant {tenant.name!r} is defined twice", "name")
        for d in digests:
            if d in owner:
                raise fail(f"tenant {tenant.name!r} has a key that tenant {owner[d]!r} already has (each key "
                           "belongs to one tenant)", "keys")
            owner[d] = tenant.name
        tenants[tenant.name] = tenant
    return TenantFile(tenants, tuple(owner.items()))


def _tenant(t: dict[str, Any], fail: Any) -> tuple[Tenant, list[bytes]]:
    unknown = sorted(set(t) - _KNOWN)
    if unknown:
        raise fail(f"unknown key {unknown[0]!r}; a tenant takes {', '.join(sorted(_KNOWN))}", unknown[0])
    name = t.get("name")
    if not isinstance(name, str) or not name.strip():
        raise fail("every tenant needs a 'name' (a non-empty string)", "name")
    digests = [digest(k) for k in _strings(t, "keys", fail, nonempty=True)]
    for h in _strings(t, "key_sha256", fail, nonempty=True):
        if not _HEX64.fullmatch(h.lower()):
            # NOTE: the value is not echoed: it may be a plain key put here by mistake.
            raise fail(f"key_sha256 entries are 64 hex digits (a SHA-256 digest); one has {len(h)} characters",
                       "key_sha256")
        digests.append(bytes.fromhex(h))
    if not digests:
        raise fail(f"tenant {name!r} has no key: give 'keys' or 'key_sha256'", "name")
    if len(set(digests)) != len(digests):
        raise fail(f"tenant {name!r} lists the same key twice", "keys")
    values: dict[str, Any] = {}
    for key in ("weight", *RATE_LIMITS):
        if key in t:
            v = t[key]
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise fail(f"{key} must be a number (got {type(v).__name__})", key)
            if not v > 0 or v != v or v == float("inf"):
                raise fail(f"{key} must be > 0 (got {v}); leave it out for no limit", key)
            values[key] = float(v)
    for key in (*TOKEN_LIMITS, *COUNT_LIMITS):
        if key in t:
            v = t[key]
            if isinstance(v, bool) or not isinstance(v, int):
                raise fail(f"{key} must be an integer (got {type(v).__name__})", key)
            if v < 1:
                raise fail(f"{key} must be >= 1 (got {v}); leave it out for no limit", key)
            values[key] = v
    if "models" in t:
        values["models"] = tuple(_strings(t, "models", fail, nonempty=True))
    return Tenant(name=name, **values), digests


def _strings(t: dict[str, Any], key: str, fail: Any, nonempty: bool) -> list[str]:
    v = t.get(key, [])
    if not isinstance(v, list) or not all(isinstance(x, str) and (x or not nonempty) for x in v):
        raise fail(f"{key} must be a list of non-empty strings", key)
    return list(v)
