"""Who runs a background response (``/v1/responses`` with ``background: true``), and whether that
process is still there.

A background run lives in the server process that started it; its record says ``in_progress``
until that process stores the end. A process that dies first (SIGKILL, a crash, a power cut)
never does, so the store also keeps each running record's owner (``instance_id``: host, pid and
the pid's start time), and a record whose owner is gone is marked ``failed`` (``failed_body``):
by every server on start-up, and by any server asked for it. NOTE: a sqlite store is shared only by
the replicas of one host, so a live owner is always one this host can see; an owner on another
host (whose liveness cannot be told from here) is never taken for gone.
"""

from __future__ import annotations

import os
import socket
from typing import Any

RUNNING = ("queued", "in_progress")
RESTARTED = ("the server that was running this background response stopped (it restarted or died) before the "
             "response finished; create it again")


def _start_time(pid: int) -> str | None:
    """The kernel's start time of ``pid`` (clock ticks since boot; None: no such process, or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[19]  # field 22, counted after the command name


def _host() -> str:
    return socket.gethostname()


def instance_id(pid: int | None = None) -> str:
    """``host:pid:start``: this process (or ``pid``) for as long as it lives; a reused pid differs by start."""
    pid = os.getpid() if pid is None else pid
    return f"{_host()}:{pid}:{_start_time(pid) or ''}"


def owner_gone(owner: str) -> bool:
    """Whether the process ``owner`` (an ``instance_id``) is certainly no longer running."""
    parts = owner.rsplit(":", 2)
    if len(parts) != 3 or not parts[1].isdigit() or parts[0] != _host():
        return False  # another host's (or not an id this module wrote): leave it alone
    pid, start = int(parts[1]), parts[2]
    now = _start_time(pid)
    if now is not None:
        return bool(start) and now != start  # the pid is another process's now
    if os.path.isdir("/proc"):
        return True
    try:  # (no /proc: the pid alone)
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def failed_body(body: dict[str, Any]) -> dict[str, Any]:
    """``body`` (a running response) as failed because its server is gone."""
    out = dict(body, status="failed", error={"code": "server_error", "message": RESTARTED})
    out["output"] = [dict(it, status="incomplete") if it.get("status") == "in_progress" else it
                     for it in body.get("output", [])]
    return out
