"""State snapshots on radix nodes: how a hybrid model's prefix-cache hit stays exact.

A recurrent state cannot be cut at an arbitrary token, so a cached prefix's K/V alone cannot
resume a hybrid model's sequence. ``StateSnapshots`` keeps, for some radix nodes, a copy of every
linear layer's state after the node's last token (a slot of its own ``StatePool``). A lookup
resumes at the deepest node on the matched path that has one (the attention layers' K/V from the
same node), so a hit computes exactly what it skips.

Snapshots are taken where the scheduler's bookkeeping already puts a request's tokens into the
tree: after each prefill chunk that does not end the prompt, and when a request ends (finished,
aborted or preempted with ``keep``: prompt + output, which an agent's next turn extends).

Ownership: the snapshot slots are this class's; a node's snapshot is freed when the store is
full (least recently used first; snapshots whose node was evicted from the tree or cleared with
it go before any live one). A snapshot pins nothing: a node's K/V may be evicted first, and its
snapshot is then dead (never found: a lookup only walks the live path of a match).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch

from tripod.memory.state_pool import StatePool, StateSpec
from tripod.protocol.stats import StateStats

_tick = itertools.count()


class StateSnapshots:
    """Owns ``capacity`` snapshot slots and which radix node each one belongs to."""

    def __init__(self, spec: StateSpec, capacity: int, device: torch.device, root: Callable[[], Any]) -> None:
        self.store = StatePool(spec, capacity, device)
        self.root = root  # the tree's current root (a node whose top is another root was cleared)
        self._of: dict[int, tuple[Any, int, int]] = {}  # id(node) -> (node, slot, last use)
        self.taken = 0
        self.restored = 0

    @property
    def used(self) -> int:
        return len(self._of)

    @property
    def used_bytes(self) -> int:
        return self.used * self.store.bytes_per_slot

    def put(self, node: Any, states: StatePool, slot: int) -> None:
        """Keep ``states``' slot ``slot`` (the state after ``node``'s last token) on ``node``."""
        if node is None or node.parent is None:
            return  # the root: the empty state needs no snapshot
        key = id(node)
        if key in self._of:  # same tokens, same state: refresh its recency only
            n, s, _ = self._of[key]
            self._of[key] = (n, s, next(_tick))
            return
        dst = self.store.alloc()
        if dst is None:
            self._evict_one()
            dst = self.store.alloc()
        assert dst is not None
        _copy(states, slot, self.store, dst)
        self._of[key] = (node, dst, next(_tick))
        self.taken += 1

    def put_values(self, node: Any, values: torch.Tensor) -> None:
        """Keep ``values`` (a snapshot's flat float32 state, as ``values`` gives it: from the disk tier
        or a KV transfer) on ``node``."""
        if node is None or node.parent is None:
            return
        hit = self._of.get(id(node))
        if hit is not None:
            dst = hit[1]
        else:
            dst = self.store.alloc()
            if dst is None:
                self._evict_one()
                dst = self.store.alloc()
            assert dst is not None
        at = 0
        for layer in self.store.tensors:
            for t in layer:
                n = t[dst].numel()
                t[dst].copy_(values[at : at + n].view(t[dst].shape))
                at += n
        assert at == values.numel(), "a snapshot of another state layout"
        self._of[id(node)] = (node, dst, next(_tick))

    def slot_of(self, node: Any) -> int | None:
        """``node``'s own snapshot slot (not an ancestor's), or None."""
        hit = self._of.get(id(node))
        return None if hit is None else hit[1]

    def values(self, slot: int) -> torch.Tensor:
        """Snapshot ``slot``'s state as one flat float32 tensor on the CPU (every linear layer's
        tensors in model order: the disk tier's and the KV transfer's state section)."""
        return torch.cat([t[slot].reshape(-1).to("cpu") for layer in self.store.tensors for t in layer])

    def held(self) -> list[Any]:
        """The live nodes that hold a snapshot."""
        return [n for n, _, _ in self._of.values() if self._live(n)]

    def find(self, node: Any) -> tuple[Any, int] | None:
        """The deepest node from ``node`` up (a live path: a fresh match) that has a snapshot."""
        while node is not None and node.parent is not None:
            hit = self._of.get(id(node))
            if hit is not None:
                self._of[id(node)] = (hit[0], hit[1], next(_tick))
                return node, hit[1]
            node = node.parent
        return None

    def restore(self, snap: int, states: StatePool, slot: int) -> None:
        _copy(self.store, snap, states, slot)
        self.restored += 1

    def _evict_one(self) -> None:
        dead = [k for k, (n, _, _) in self._of.items() if not self._live(n)]
        victim = dead[0] if dead else min(self._of, key=lambda k: self._of[k][2])
        _, slot, _ = self._of.pop(victim)
        self.store.free(slot)

    def _live(self, node: Any) -> bool:
        while node.parent is not None:
            if node.parent.children.get(node.key[0]) is not node:
                return False
            node = node.parent
        return node is self.root()

    def clear(self) -> None:
        for _, slot, _ in self._of.values():
            self.store.free(slot)
        self._of.clear()


def _copy(src: StatePool, s: int, dst: StatePool, d: int) -> None:
    for a, b in zip(src.tensors, dst.tensors, strict=True):
        for x, y in zip(a, b, strict=True):
            y[d].copy_(x[s])


def state_stats(pool: StatePool, snapshots: StateSnapshots | None) -> StateStats:
    """What ``/debug/engine`` reports of a hybrid engine's state memory."""
    out = StateStats(slots=pool.num_slots, free=pool.num_free, bytes_per_slot=pool.bytes_per_slot)
    if snapshots is not None:
        out.snapshot_slots = snapshots.store.num_slots
        out.snapshots_held = snapshots.used
        out.snapshot_bytes = snapshots.used_bytes
        out.snapshots_taken = snapshots.taken
        out.snapshots_restored = snapshots.restored
    return out
