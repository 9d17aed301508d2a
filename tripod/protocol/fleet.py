"""The fleet's own edge: what a Ray replica actor reports to the driver when its ``tripod serve``
has started on its node (the actor returns it through Ray, pickled)."""

from __future__ import annotations

import msgspec


class ReplicaStarted(msgspec.Struct, frozen=True, kw_only=True):
    url: str  # where the router reaches it
    pid: int  # of tripod serve, on its node
    node_id: str
    node_ip: str
    log_path: str  # on the replica's node
