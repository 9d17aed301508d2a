"""Follow-up affinity for the Responses API: which replica answered each response id, so that a
``previous_response_id`` follow-up goes back to it (its prefix cache holds the conversation so far,
which the router cannot see: the follow-up carries only the new turn).

Learned from the answers the router passes back: a whole ``Response`` object's ``id``, or a
stream's first event (``response.created``, whose ``response.id`` comes first). Bounded: the
``max_entries`` most recent ids (least recently used forgotten first). A follow-up whose replica is
not routable now (down, draining, unknown) is placed by the router's normal policy instead, as is
one whose previous response went through another router.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from collections.abc import Callable

# The id of the response a stream's first event announces (``"response":{"id":"resp_..."``).
_STREAM_ID = re.compile(rb'"response"\s*:\s*\{\s*"id"\s*:\s*"([A-Za-z0-9_\-]{1,200})"')
_SCAN_LIMIT = 16384  # bytes of a stream scanned for its id (its first event is far shorter)


class ResponseAffinity:
    """response id → the name of the replica that answered it (LRU, at most ``max_entries``)."""

    def __init__(self, max_entries: int = 65536) -> None:
        assert max_entries >= 1
        self.max_entries = max_entries
        self._where: OrderedDict[str, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._where)

    def remember(self, rid: str, replica: str) -> None:
        self._where[rid] = replica
        self._where.move_to_end(rid)
        while len(self._where) > self.max_entries:
            self._where.popitem(last=False)

    def replica_of(self, rid: str) -> str | None:
        name = self._where.get(rid)
        if name is not None:
            self._where.move_to_end(rid)
        return name

    def learn_whole(self, content: bytes, replica: str) -> None:
        """A whole answer: a ``Response`` object (a background one's too)."""
        try:
            obj = json.loads(content)
        except ValueError:
            return
        if isinstance(obj, dict) and obj.get("object") == "response" and isinstance(obj.get("id"), str):
            self.remember(obj["id"], replica)

    def stream_watcher(self, replica: str) -> Callable[[bytes], bool]:
        """A function fed a stream's chunks in order until it returns True (the id found, or the
        scan given up past ``_SCAN_LIMIT`` bytes)."""
        seen = bytearray()

        def feed(chunk: bytes) -> bool:
            seen.extend(chunk)
            m = _STREAM_ID.search(seen)
            if m is not None:
                self.remember(m.group(1).decode(), replica)
                return True
            return len(seen) > _SCAN_LIMIT

        return feed
