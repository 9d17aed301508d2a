"""The Responses API's stores without a model: the memory store's caps under a flood, its TTL and
tenants; the sqlite store's durability (a writer SIGKILLed right after its puts loses none), its
sharing between processes, and its refusal of corrupt and foreign files."""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tripod.server.response_store import (
    MemoryResponseStore,
    SqliteResponseStore,
    StoredResponse,
    StoreError,
    StoreFull,
    open_store,
)


def rec(i: int, tenant: str = "default", pad: int = 0) -> StoredResponse:
    return StoredResponse(f"resp_{i}", tenant, {"id": f"resp_{i}", "output": [], "pad": "x" * pad},
                          [{"id": f"msg_{i}", "type": "message"}], None, 0.0)


def test_memory_store_never_exceeds_its_caps() -> None:
    s = MemoryResponseStore(max_count=50, max_bytes=20_000, ttl=60)
    for i in range(2000):
        s.put(rec(i, pad=(i * 37) % 700))
        assert len(s) <= 50 and s.bytes <= 20_000
    assert s.get("resp_1999", "default") is not None  # the newest stays
    assert s.get("resp_0", "default") is None  # the oldest went
    with pytest.raises(StoreFull):
        s.put(rec(5000, pad=30_000))
    assert len(s) <= 50 and s.bytes <= 20_000


def test_memory_store_lru_ttl_and_tenants() -> None:
    now = [0.0]
    s = MemoryResponseStore(max_count=2, max_bytes=10**6, ttl=10, clock=lambda: now[0])
    s.put(rec(1))
    s.put(rec(2))
    assert s.get("resp_1", "default") is not None  # 1 is now the most recently used
    s.put(rec(3))
    assert s.get("resp_2", "default") is None and s.get("resp_1", "default") is not None
    assert s.get("resp_1", "other") is None and not s.delete("resp_1", "other")
    now[0] = 11.0
    assert s.get("resp_1", "default") is None and len(s) == 1  # expired, dropped


def test_sqlite_survives_sigkill_and_is_shared(tmp_path: Path) -> None:
    path = tmp_path / "responses.db"
    code = textwrap.dedent(f"""
        import os, signal, sys
        from tripod.server.response_store import SqliteResponseStore, StoredResponse
        s = SqliteResponseStore({str(path)!r}, ttl=3600)
        for i in range(20):
            s.put(StoredResponse(f"resp_{{i}}", "t", {{"i": i}}, [], None, 0.0))
        print("stored", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == -signal.SIGKILL and "stored" in p.stdout, p.stderr
    s = SqliteResponseStore(str(path), ttl=3600)
    assert [s.get(f"resp_{i}", "t").body["i"] for i in range(20)] == list(range(20))  # type: ignore[union-attr]
    assert s.get("resp_1", "other") is None
    other = SqliteResponseStore(str(path), ttl=3600)  # a second replica on the same file
    other.put(rec(99, "t"))
    assert s.get("resp_99", "t") is not None and s.delete("resp_99", "t") and other.get("resp_99", "t") is None
    assert sqlite3.connect(path).execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    s.close()
    other.close()


def test_sqlite_refuses_foreign_and_corrupt_files(tmp_path: Path) -> None:
    foreign = tmp_path / "app.db"
    db = sqlite3.connect(foreign)
    db.execute("CREATE TABLE users (id INTEGER)")
    db.commit()
    db.close()
    with pytest.raises(StoreError, match="another program"):
        SqliteResponseStore(str(foreign), ttl=10)
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"this is not a database at all" * 100)
    with pytest.raises(StoreError, match=r"not a usable sqlite file|corrupt"):
        SqliteResponseStore(str(junk), ttl=10)
    with pytest.raises(StoreError, match="memory"):
        open_store("redis://x", max_count=1, max_bytes=1, ttl=1)


def _running(i: int, owner: str) -> StoredResponse:
    body = {"id": f"resp_{i}", "status": "in_progress", "background": True,
            "output": [{"id": f"msg_{i}", "type": "message", "status": "in_progress", "content": []}]}
    return StoredResponse(f"resp_{i}", "t", body, [], None, 0.0, owner=owner)


def test_runs_of_a_dead_owner_fail_and_a_live_owners_do_not(tmp_path: Path) -> None:
    """A background record left ``in_progress`` by a process that has exited is marked failed
    (on a store's sweep, and when it is read); a live process's (another replica's) stays running,
    as does a record stored as ended."""
    from tripod.server.run_owner import instance_id, owner_gone

    dead = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    dead_owner = instance_id(dead.pid)  # taken while it runs, then it exits
    dead.kill()
    dead.wait()
    assert owner_gone(dead_owner) and not owner_gone(instance_id())
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        path = str(tmp_path / "r.db")
        s = SqliteResponseStore(path, ttl=3600)
        s.put(_running(1, dead_owner))
        s.put(_running(2, instance_id(live.pid)))
        s.put(_running(3, dead_owner))
        s.put(StoredResponse("resp_3", "t", {"id": "resp_3", "status": "completed", "output": []}, [], None, 0.0,
                             owner=dead_owner))  # it ended: not an orphan
        s.put(_running(4, dead_owner))
        again = SqliteResponseStore(path, ttl=3600)  # a restarted server on the file
        assert sorted(again.fail_orphans()) == ["resp_1", "resp_4"]
        one = again.get("resp_1", "t")
        assert one is not None and one.body["status"] == "failed" and "restarted" in one.body["error"]["message"]
        assert one.body["output"][0]["status"] == "incomplete"
        assert s.get("resp_2", "t").body["status"] == "in_progress"  # type: ignore[union-attr]
        assert s.get("resp_3", "t").body["status"] == "completed"  # type: ignore[union-attr]
        assert again.fail_orphans() == []
        live.kill()
        live.wait()
        got = s.get("resp_2", "t")  # read after its owner died: failed then
        assert got is not None and got.body["status"] == "failed"
        s.close()
        again.close()
    finally:
        live.kill()
        live.wait()
