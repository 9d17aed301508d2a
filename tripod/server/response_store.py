"""Where ``/v1/responses`` keeps what it answered (``store: true``): each response's body and its
input items, so ``previous_response_id``, ``GET /v1/responses/{id}``, ``.../input_items`` and
``DELETE`` work.

Two stores behind one interface (``ResponseStore``), chosen by ``--responses-store``:

- ``memory`` (the default): bounded by count and bytes (``--responses-max-count``,
  ``--responses-max-bytes``), least recently used evicted first, each record dropped past
  ``--responses-ttl`` seconds. NOTE: the caps hold after every ``put``: a record larger than the
  byte cap on its own is refused (``StoreFull``), never kept past it.
- ``sqlite:PATH``: durable (a restart, SIGKILL included, keeps every committed record: each
  ``put`` is one transaction, WAL mode), shareable by a fleet's replicas on one host (one file, a
  busy timeout). A file that is not a tripod store (corrupt, or another program's database) is
  refused at start-up with a message (``StoreError``). A background run's record names the process
  running it; one whose process is gone is marked ``failed`` on start-up and when asked for
  (``fail_orphans``, ``server/run_owner.py``), never a live replica's.

Records belong to a tenant: ``get``/``delete`` with another tenant's name find nothing (the route
answers 404, as for an id that never existed).
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Protocol

from tripod.server.run_owner import RUNNING, failed_body, owner_gone

__all__ = ["MemoryResponseStore", "ResponseStore", "SqliteResponseStore", "StoreError", "StoreFull",
           "StoredResponse", "open_store"]

FORMAT = "tripod-responses-1"  # the sqlite file's format tag (tripod_meta.format)


class StoreError(ValueError):
    """The store cannot be opened as asked (a bad ``--responses-store``, a foreign or corrupt file)."""


class StoreFull(ValueError):
    """A record too large for the memory store's byte cap."""


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """One stored response: its ``Response`` body, this turn's input items (with ids) and the
    conversation before it (``previous_response_id``), as JSON-shaped data."""

    id: str
    tenant: str
    body: dict[str, Any]
    input_items: list[dict[str, Any]]
    previous_response_id: str | None
    created_at: float
    history: list[dict[str, Any]] = field(default_factory=list)  # the items of every earlier turn
    # A background run stored while it runs: the process running it (``run_owner.instance_id``),
    # so that a store shared past that process's life can tell the run will never end.
    owner: str | None = None

    def encoded(self) -> tuple[str, str, str]:
        def enc(x: Any) -> str:
            return json.dumps(x, separators=(",", ":"))

        return enc(self.body), enc(self.input_items), enc(self.history)


class ResponseStore(Protocol):
    """What the Responses surface needs of a store (thread-safe; each call is short)."""

    def put(self, rec: StoredResponse) -> None: ...

    def get(self, rid: str, tenant: str) -> StoredResponse | None: ...

    def delete(self, rid: str, tenant: str) -> bool: ...

    def fail_orphans(self) -> list[str]: ...

    def close(self) -> None: ...


class MemoryResponseStore:
    """Bounded LRU + TTL store in this process. Owns the invariant ``len <= max_count`` and
    ``bytes <= max_bytes`` after every call."""

    def __init__(self, max_count: int, max_bytes: int, ttl: float, clock: Any = time.monotonic) -> None:
        if max_count < 1 or max_bytes < 1 or ttl <= 0:
            raise StoreError("the memory store needs max_count >= 1, max_bytes >= 1 and ttl > 0")
        self.max_count, self.max_bytes, self.ttl = max_count, max_bytes, ttl
        self._clock = clock
        self._lock = threading.Lock()
        # id -> (tenant, body json, items json, previous id, created_at, expires, size, history json)
        self._items: OrderedDict[str, tuple[str, str, str, str | None, float, float, int, str]] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def put(self, rec: StoredResponse) -> None:
        body, items, history = rec.encoded()
        size = len(body) + len(items) + len(history) + len(rec.id)
        if size > self.max_bytes:
            raise StoreFull(f"the response is {size} bytes, more than the store holds "
                            f"(--responses-max-bytes {self.max_bytes}); send store: false")
        with self._lock:
            self._drop(rec.id)
            self._items[rec.id] = (rec.tenant, body, items, rec.previous_response_id, rec.created_at,
                                   self._clock() + self.ttl, size, history)
            self.bytes += size
            while len(self._items) > self.max_count or self.bytes > self.max_bytes:
                self._drop(next(iter(self._items)))

    def get(self, rid: str, tenant: str) -> StoredResponse | None:
        with self._lock:
            v = self._items.get(rid)
            if v is None:
                return None
            if v[5] <= self._clock():
                self._drop(rid)
                return None
            if v[0] != tenant:
                return None
            self._items.move_to_end(rid)
        return StoredResponse(rid, v[0], json.loads(v[1]), json.loads(v[2]), v[3], v[4], json.loads(v[7]))

    def delete(self, rid: str, tenant: str) -> bool:
        with self._lock:
            v = self._items.get(rid)
            if v is None or v[0] != tenant:
                return False
            self._drop(rid)
            return True

    def fail_orphans(self) -> list[str]:
        """None here: this store's records live and die with the process that runs their runs."""
        return []

    def _drop(self, rid: str) -> None:
        v = self._items.pop(rid, None)
        if v is not None:
            self.bytes -= v[6]

    def close(self) -> None:
        with self._lock:
            self._items.clear()
            self.bytes = 0


_SCHEMA = """
CREATE TABLE IF NOT EXISTS tripod_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS tripod_responses (
  id TEXT PRIMARY KEY, tenant TEXT NOT NULL, body TEXT NOT NULL, input_items TEXT NOT NULL,
  previous_response_id TEXT, created_at REAL NOT NULL, expires_at REAL NOT NULL, history TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS tripod_runs (id TEXT PRIMARY KEY, owner TEXT NOT NULL);
"""


class SqliteResponseStore:
    """A durable store in one sqlite file (WAL). Several processes may share it: each ``put`` is
    one committed transaction, and readers see every committed record. Records past ``ttl`` are
    not returned and are deleted as new ones come."""

    def __init__(self, path: str, ttl: float) -> None:
        self.path, self.ttl = path, ttl
        self._lock = threading.Lock()
        try:
            self._db = sqlite3.connect(path, timeout=10.0, check_same_thread=False, isolation_level=None)
            self._open()
        except sqlite3.DatabaseError as e:
            raise StoreError(f"--responses-store sqlite:{path}: not a usable sqlite file ({e}); "
                             "give a new path or remove the file") from None

    def _open(self) -> None:
        db = self._db
        tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if tables and "tripod_meta" not in tables:
            raise StoreError(f"--responses-store sqlite:{self.path}: the file is another program's database "
                             f"(tables: {', '.join(sorted(tables))}); give a path of its own")
        if "tripod_meta" in tables:
            row = db.execute("SELECT value FROM tripod_meta WHERE key='format'").fetchone()
            if row is None or row[0] != FORMAT:
                raise StoreError(f"--responses-store sqlite:{self.path}: format {row and row[0]!r}, "
                                 f"expected {FORMAT!r}; give a new path")
        ok = db.execute("PRAGMA quick_check").fetchone()
        if ok is None or ok[0] != "ok":
            raise StoreError(f"--responses-store sqlite:{self.path}: the file is corrupt ({ok}); remove it")
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")  # NOTE: a committed put survives a power cut too
        db.executescript(_SCHEMA)
        db.execute("INSERT OR IGNORE INTO tripod_meta VALUES ('format', ?)", (FORMAT,))

    def put(self, rec: StoredResponse) -> None:
        body, items, history = rec.encoded()
        now = time.time()
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute("DELETE FROM tripod_responses WHERE expires_at <= ?", (now,))
                self._db.execute("INSERT OR REPLACE INTO tripod_responses VALUES (?,?,?,?,?,?,?,?)",
                                 (rec.id, rec.tenant, body, items, rec.previous_response_id, rec.created_at,
                                  now + self.ttl, history))
                if rec.owner is not None and rec.body.get("status") in RUNNING:
                    self._db.execute("INSERT OR REPLACE INTO tripod_runs VALUES (?,?)", (rec.id, rec.owner))
                else:
                    self._db.execute("DELETE FROM tripod_runs WHERE id=?", (rec.id,))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def get(self, rid: str, tenant: str) -> StoredResponse | None:
        rec = self._get(rid, tenant)
        if rec is not None and rec.body.get("status") in RUNNING and self.fail_orphans(rid):
            rec = self._get(rid, tenant)  # its server is gone: failed now
        return rec

    def fail_orphans(self, rid: str | None = None) -> list[str]:
        """Mark ``failed`` every running record (or just ``rid``) whose owner process is gone
        (``run_owner``); returns their ids. A live owner's runs (another replica's) are left alone."""
        with self._lock:
            q = "SELECT id, owner FROM tripod_runs" + (" WHERE id=?" if rid is not None else "")
            rows = self._db.execute(q, (rid,) if rid is not None else ()).fetchall()
            gone = [r[0] for r in rows if owner_gone(r[1])]
            if not gone:
                return []
            self._db.execute("BEGIN IMMEDIATE")
            try:
                for i in gone:
                    row = self._db.execute("SELECT body FROM tripod_responses WHERE id=?", (i,)).fetchone()
                    body = json.loads(row[0]) if row is not None else None
                    if body is not None and body.get("status") in RUNNING:  # (not ended meanwhile)
                        self._db.execute("UPDATE tripod_responses SET body=? WHERE id=?",
                                         (json.dumps(failed_body(body), separators=(",", ":")), i))
                    self._db.execute("DELETE FROM tripod_runs WHERE id=?", (i,))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return gone

    def _get(self, rid: str, tenant: str) -> StoredResponse | None:
        with self._lock:
            row = self._db.execute(
                "SELECT body, input_items, previous_response_id, created_at, history FROM tripod_responses "
                "WHERE id=? AND tenant=? AND expires_at > ?", (rid, tenant, time.time())).fetchone()
        if row is None:
            return None
        return StoredResponse(rid, tenant, json.loads(row[0]), json.loads(row[1]), row[2], row[3], json.loads(row[4]))

    def delete(self, rid: str, tenant: str) -> bool:
        with self._lock:
            cur = self._db.execute("DELETE FROM tripod_responses WHERE id=? AND tenant=?", (rid, tenant))
            if cur.rowcount > 0:
                self._db.execute("DELETE FROM tripod_runs WHERE id=?", (rid,))
        return cur.rowcount > 0

    def close(self) -> None:
        with self._lock:
            self._db.close()


def open_store(spec: str, *, max_count: int, max_bytes: int, ttl: float) -> MemoryResponseStore | SqliteResponseStore:
    """``--responses-store``: ``memory`` or ``sqlite:PATH`` (a ``StoreError`` saying what to change)."""
    if spec == "memory":
        return MemoryResponseStore(max_count, max_bytes, ttl)
    if spec.startswith("sqlite:") and spec[len("sqlite:"):]:
        return SqliteResponseStore(spec[len("sqlite:"):], ttl)
    raise StoreError(f"--responses-store must be 'memory' or 'sqlite:PATH' (got {spec!r})")
