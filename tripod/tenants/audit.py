"""``--audit-log FILE``: one JSON line per authenticated request, written off the request path.

A line: ``time`` (ISO 8601, UTC), ``tenant``, ``key_id`` (a short prefix of the key's SHA-256
digest: never the key), ``route``, ``model``, ``status``, ``prompt_tokens``, ``output_tokens``,
``latency_s``, and, only with ``--audit-log-content``, ``prompt`` (the prompt's text). Requests
write into a queue; one thread writes the file, rotated by size (``max_bytes``, ``backups`` old
files kept as FILE.1 ... FILE.N), so a slow disk never delays an answer.
"""

from __future__ import annotations

import json
import logging
import logging.handlers
import queue
import threading
from dataclasses import asdict, dataclass
from typing import Any

log = logging.getLogger("tripod.tenants")

DEFAULT_MAX_BYTES = 64 * 2**20
DEFAULT_BACKUPS = 5


@dataclass(frozen=True, slots=True)
class AuditLine:
    time: str
    tenant: str
    key_id: str
    route: str
    model: str | None
    status: int
    prompt_tokens: int
    output_tokens: int
    latency_s: float
    prompt: str | None = None

    def json(self) -> str:
        d: dict[str, Any] = asdict(self)
        if d["prompt"] is None:
            del d["prompt"]
        return json.dumps(d, ensure_ascii=False, separators=(",", ":"))


class AuditLog:
    """The writer thread and its queue; ``content``: whether lines may carry the prompt's text."""

    def __init__(self, path: str, content: bool = False, max_bytes: int = DEFAULT_MAX_BYTES,
                 backups: int = DEFAULT_BACKUPS) -> None:
        self.content = content
        self.handler = logging.handlers.RotatingFileHandler(path, maxBytes=max_bytes, backupCount=backups,
                                                            encoding="utf-8")
        self.handler.setFormatter(logging.Formatter("%(message)s"))
        self.queue: queue.SimpleQueue[AuditLine | threading.Event | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._write, name="tripod-audit", daemon=True)
        self.thread.start()

    def write(self, line: AuditLine) -> None:
        if not self.content and line.prompt is not None:
            line = AuditLine(**{**asdict(line), "prompt": None})
        self.queue.put(line)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every line written so far is on disk."""
        done = threading.Event()
        self.queue.put(done)
        return done.wait(timeout)

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join(timeout=10.0)
        self.handler.close()

    def _write(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                return
            if isinstance(item, threading.Event):
                self.handler.flush()
                item.set()
                continue
            try:
                self.handler.handle(logging.makeLogRecord({"msg": item.json(), "levelno": logging.INFO,
                                                           "levelname": "INFO"}))
            except Exception:
                log.exception("audit log: a line could not be written")
