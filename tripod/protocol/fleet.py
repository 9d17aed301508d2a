"""The fleet's own edges: what a Ray replica actor reports to the driver when its ``tripod serve``
has started on its node (the actor returns it through Ray, pickled), and what a router says of
each of its replicas (``ReplicaInfo``: ``/fleet``'s ``replicas``, the chain server's ``/chain``)."""

from __future__ import annotations

from typing import Literal

import msgspec
from msgspec import UNSET, UnsetType


class ReplicaStarted(msgspec.Struct, frozen=True, kw_only=True):
    url: str  # where the router reaches it
    pid: int  # of tripod serve, on its node
    node_id: str
    node_ip: str
    log_path: str  # on the replica's node


class ReplicaInfo(msgspec.Struct, kw_only=True):
    """One replica as its router sees it: its circuit's state, the load the router sent it and the
    replica's own counts, and what it probably has cached. The field order is the JSON's."""

    name: str
    url: str
    state: Literal["healthy", "starting", "unhealthy", "draining"]
    pid: int | None  # when this process launched it
    inflight: int  # attempts the router sent it that have not ended
    inflight_tokens: float
    running: int  # the replica's own counts (its /metrics)
    waiting: int
    routed: int
    failures: int
    restarts: int
    continues: bool  # it reports resume points (the router's failover)
    estimated_hit_rate: float | None  # None before any request was routed to it
    tree_chars: int
    labels: dict[str, str]
    role: str  # prefill | decode | both
    kv_tier: str | None
    tier_tree_chars: int | None
    counters: dict[str, float]  # its cache tiers' and KV transfers' counters at the last scrape
    # A Ray replica: its actor and the node it was placed on (left out of the JSON otherwise).
    actor_name: str | UnsetType = UNSET
    node_id: str | UnsetType = UNSET
