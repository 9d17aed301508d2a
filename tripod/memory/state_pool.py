"""Recurrent state of linear-attention / state-space layers: one slot per running sequence.

A hybrid model (Qwen3.5, Qwen3-Next, ...) keeps per-token K/V only in its attention layers (the
``KVPool``, unchanged); each of its linear layers instead carries a fixed-size state per sequence
that every token updates in place. ``StatePool`` holds those states: slot ``s`` is one sequence's
state in every linear layer, each layer's state being a list of float32 tensors whose shapes the
model names (``StateSpec``: e.g. the gated delta rule's conv window ``[channels, kernel - 1]``
and recurrent state ``[heads, k_dim, v_dim]``; a Mamba2 layer names its own).

Ownership: a slot is free or held by exactly one running request (``Req.state_slot``); the
scheduler takes one at admission (zeroed: a sequence starts from the empty state) and gives it
back when the request finishes, is aborted or is retracted (a retracted request recomputes its
tokens from the start, so nothing of its state is worth keeping).

Speculative verification (``StateTrace``): a verify item runs ``[last token, d1 .. dk]`` through
the linear layers, which advance the slot's state over every draft. The mixers also keep the state
after each of those rows in the step's trace; once the drafts are judged, ``StateTrace.settle``
puts back the state after the last kept row, so a rejected draft leaves no trace in the state.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StateSpec:
    """The state of one sequence: per linear layer (in model order) the shapes of its float32
    state tensors."""

    layers: tuple[tuple[tuple[int, ...], ...], ...]

    def values_per_slot(self) -> int:
        total = 0
        for shapes in self.layers:
            for shape in shapes:
                n = 1
                for d in shape:
                    n *= d
                total += n
        return total

    def bytes_per_slot(self) -> int:
        return 4 * self.values_per_slot()  # float32, as the reference keeps them


class StatePool:
    """Owns ``num_slots`` float32 state slots of every linear layer and their free list.

    ``tensors[i][j]`` is linear layer ``i``'s ``j``-th state, ``[num_slots, *shape]``.
    Invariant: a slot id is in the free list or held by one request, never both (``free`` of a
    free slot is an engine bug and asserts)."""

    def __init__(self, spec: StateSpec, num_slots: int, device: torch.device) -> None:
        if num_slots < 1:
            raise ValueError(f"the state pool needs at least one slot (got {num_slots})")
        self.spec = spec
        self.num_slots = num_slots
        self.tensors: list[list[torch.Tensor]] = [
            [torch.zeros((num_slots, *shape), dtype=torch.float32, device=device) for shape in shapes]
            for shapes in spec.layers
        ]
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # pop() hands out 0 first
        self._free_set = set(self._free)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def bytes_per_slot(self) -> int:
        return self.spec.bytes_per_slot()

    @property
    def total_bytes(self) -> int:
        return self.num_slots * self.bytes_per_slot

    def alloc(self) -> int | None:
        """A free slot with every layer's state zeroed (None: all are held)."""
        if not self._free:
            return None
        slot = self._free.pop()
        self._free_set.discard(slot)
        for layer in self.tensors:
            for t in layer:
                t[slot].zero_()
        return slot

    def free(self, slot: int) -> None:
        assert 0 <= slot < self.num_slots and slot not in self._free_set, f"state slot {slot} freed twice"
        self._free.append(slot)
        self._free_set.add(slot)

    def free_set(self) -> set[int]:
        return set(self._free_set)


class StateTrace:
    """The states after every row of a step's verify items, kept until their drafts are judged.

    ``slots``: the state slots whose items verify drafts (a mixer records only those).
    ``rows[(layer, slot)]``: per state tensor of linear layer ``layer``, ``[n + 1, *shape]`` for
    an item of ``n`` rows — entry ``r`` is the state after the item's first ``r`` rows (entry 0:
    before the step; the pool's slot holds entry ``n``).
    Invariant: after ``settle`` the slot holds exactly the state after its last kept row, the
    same tensors a run without the rejected rows would have left (each entry is a copy of the
    state the mixer's own token step produced)."""

    def __init__(self, pool: StatePool, slots: frozenset[int]) -> None:
        self.pool = pool
        self.slots = slots
        self.num_layers = len(pool.tensors)
        self.rows: dict[tuple[int, int], list[torch.Tensor]] = {}

    def wants(self, slot: int) -> bool:
        return slot in self.slots

    def put(self, layer: int, slot: int, states: list[torch.Tensor]) -> None:
        """Linear layer ``layer``'s states before and after each row of slot ``slot``'s item (``[n + 1, *shape]`` each)."""
        self.rows[(layer, slot)] = states

    def settle(self, slot: int, kept: int) -> None:
        """Slot ``slot``'s item keeps its first ``kept`` rows: its state becomes the state after
        them in every linear layer (unchanged when every row is kept)."""
        assert slot in self.slots, f"state slot {slot} verified no drafts this step"
        for layer in range(self.num_layers):
            states = self.rows.pop((layer, slot), None)
            assert states is not None, f"linear layer {layer} kept no per-row states for slot {slot}"
            assert 0 <= kept < states[0].shape[0], f"{kept} rows kept of {states[0].shape[0] - 1}"
            if kept == states[0].shape[0] - 1:
                continue
            for t, rows in zip(self.pool.tensors[layer], states, strict=True):
                t[slot].copy_(rows[kept])


def state_slots(max_running: int, requested: int | None) -> int:
    """How many state slots to allocate: ``requested`` (``--max-state-slots``) or one per running
    sequence; more than ``max_running`` would never be used."""
    if requested is None:
        return max_running
    if requested < 1:
        raise ValueError(f"--max-state-slots must be >= 1 (got {requested})")
    return min(requested, max_running)


def check_fits(spec: StateSpec, num_slots: int, available: int, what: str) -> None:
    """Refuse at start-up, saying what to change, when ``num_slots`` states exceed ``available`` bytes."""
    need = spec.bytes_per_slot() * num_slots
    if need > available:
        per = spec.bytes_per_slot()
        raise ValueError(
            f"the recurrent state of {num_slots} sequences needs {need / 2**20:.1f} MiB "
            f"({per / 2**20:.2f} MiB per sequence over {len(spec.layers)} linear layers) but only "
            f"{available / 2**20:.1f} MiB of {what} is available: lower --max-running (or --max-state-slots)")
