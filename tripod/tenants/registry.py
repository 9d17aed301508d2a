"""Who is calling: the key → tenant lookup over the current tenants file, and its live reload.

The plain ``--api-key`` (alone or beside ``--tenants``) belongs to the tenant named ``default``:
the file's, with its limits, when it defines one; else a built-in ``default`` tenant with no
limits and weight 1. Without any key at all, every request is ``default``'s (today's behaviour).

Keys are compared as SHA-256 digests with ``hmac.compare_digest`` against every known digest (no
early exit): the time taken does not depend on which key, if any, matched. A reload (SIGHUP, or
the file's mtime/size changing) swaps the whole table at once, so a rotated key works and a revoked
one is refused from the next request on; an invalid file is logged and the last good one kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import signal
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from tripod.tenants.model import (
    DEFAULT_TENANT,
    Tenant,
    TenantFile,
    TenantFileError,
    digest,
    key_id,
    load_tenants,
)

log = logging.getLogger("tripod.tenants")

RELOAD_POLL_SECONDS = 1.0


@dataclass(frozen=True, slots=True)
class Identity:
    """An authenticated caller: its tenant and its key's public id (``-``: no key needed)."""

    tenant: Tenant
    key_id: str


@dataclass(frozen=True, slots=True)
class _Table:
    tenants: dict[str, Tenant]
    keys: tuple[tuple[bytes, Tenant], ...]


class TenantRegistry:
    """The current key table, built from the tenants file (``path``) and the plain ``api_key``."""

    def __init__(self, path: str | None, api_key: str | None) -> None:
        self.path = path
        self._api_digest = digest(api_key) if api_key else None
        self.reloads = 0  # successful loads after the first
        self.reload_failures = 0
        self.on_reload: list[Callable[[bool], None]] = []
        self._stamp: tuple[int, int] | None = None
        self.table = self._build(load_tenants(path) if path else TenantFile({}, ()))
        self._stamp = self._file_stamp()

    @property
    def open(self) -> bool:
        """No key is needed (no --api-key, no --tenants): every request is ``default``'s."""
        return not self.table.keys

    @property
    def enabled(self) -> bool:
        return self.path is not None

    def tenants(self) -> dict[str, Tenant]:
        return self.table.tenants

    def _build(self, f: TenantFile) -> _Table:
        tenants = dict(f.tenants)
        by_name = tenants
        keys = [(d, by_name[name]) for d, name in f.keys]
        if self._api_digest is not None:
            if any(d == self._api_digest for d, _ in f.keys):
                raise TenantFileError(f"{self.path}: the --api-key is also one of the file's tenant keys; "
                                      "each key belongs to one tenant")
            tenants.setdefault(DEFAULT_TENANT, Tenant(DEFAULT_TENANT))
            keys.append((self._api_digest, tenants[DEFAULT_TENANT]))
        elif not keys:
            tenants.setdefault(DEFAULT_TENANT, Tenant(DEFAULT_TENANT))
        return _Table(tenants, tuple(keys))

    def identify(self, key: str | None) -> Identity | None:
        """The caller holding ``key`` (None when the key is unknown or missing and one is needed)."""
        table = self.table
        if not table.keys:
            return Identity(table.tenants[DEFAULT_TENANT], "-")
        if not key:
            return None
        d = digest(key)
        found: Tenant | None = None
        for known, tenant in table.keys:
            # NOTE: no early exit: every digest is compared, each in constant time.
            if hmac.compare_digest(known, d):
                found = tenant
        return Identity(found, key_id(d)) if found is not None else None

    # ------------------------------------------------------------ reload
    def _file_stamp(self) -> tuple[int, int] | None:
        if self.path is None:
            return None
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size

    def reload(self, why: str = "reload") -> bool:
        """Read the file again; on an error keep the table in use and log why. True when swapped."""
        if self.path is None:
            return False
        self._stamp = self._file_stamp()
        try:
            table = self._build(load_tenants(self.path))
        except TenantFileError as e:
            self.reload_failures += 1
            log.error("tenants file not reloaded (%s), keeping the last good one: %s", why, e)
            ok = False
        else:
            self.table = table
            self.reloads += 1
            log.info("tenants file reloaded (%s): %d tenant(s), %d key(s)", why, len(table.tenants), len(table.keys))
            ok = True
        for cb in self.on_reload:
            cb(ok)
        return ok

    def poll(self) -> bool:
        """Reload when the file's mtime or size changed since the last read."""
        if self.path is not None and self._file_stamp() != self._stamp:
            return self.reload("the file changed")
        return False

    @contextlib.asynccontextmanager
    async def watching(self) -> AsyncIterator[None]:
        """While inside: reload on SIGHUP and when the file changes (polled every second)."""
        if self.path is None:
            yield
            return
        loop = asyncio.get_running_loop()
        hup = False
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(signal.SIGHUP, lambda: self.reload("SIGHUP"))
            hup = True

        async def poll() -> None:
            while True:
                await asyncio.sleep(RELOAD_POLL_SECONDS)
                self.poll()

        task = asyncio.create_task(poll())
        try:
            yield
        finally:
            task.cancel()
            if hup:
                loop.remove_signal_handler(signal.SIGHUP)
