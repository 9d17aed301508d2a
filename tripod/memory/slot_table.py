"""The slot table: one int32 row of KV slot ids per running request, for kernels that read the
pool directly (``kernels.paged_attention``: query ``t`` attends ``table[rows[t], :lens[t]]``).

A request's slots live in a Python list (``Req.slots``) that the scheduler and the radix cache
edit; the table mirrors it lazily. Appends (a decode's new slot, a prefill chunk's run) are
copied as they are first needed; any other edit (the prefix cache swapping in its own slots for
duplicates, a verification giving unused draft slots back, a release) bumps
``slots_version``, and the row is rewritten on its next use.

Invariants:
- ``table[row, :synced]`` equals ``req.slots[:synced]`` for every request holding a row, as of
  the request's ``slots_version`` recorded with it.
- A row is held only while its request holds slots: rows of requests that released theirs
  (finished, aborted, retracted) are reclaimed on the next ``sync``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


class HasSlots(Protocol):
    slots: list[int]
    slots_version: int


@dataclass(slots=True)
class _Row:
    req: HasSlots
    row: int
    synced: int
    version: int


class SlotTable:
    """Owns the table tensor and the request → row map."""

    def __init__(self, max_len: int, device: torch.device, rows: int = 16, width: int = 1024) -> None:
        self.max_len = max_len
        self.device = device
        with torch.inference_mode():  # NOTE: only ever updated inside inference mode (the step)
            self.table = torch.zeros((rows, min(width, max_len)), dtype=torch.int32, device=device)
        self._rows: dict[int, _Row] = {}  # id(req) -> its row
        self._free: list[int] = list(range(rows - 1, -1, -1))

    @property
    def rows_in_use(self) -> int:
        return len(self._rows)

    @torch.inference_mode()
    def sync(self, needs: list[tuple[HasSlots, int]]) -> list[int]:
        """Make the table hold ``req.slots[:n]`` for each ``(req, n)``; returns their rows."""
        self._reclaim()
        width = max((n for _, n in needs), default=0)
        if width > self.table.shape[1]:
            self._grow(len(self._rows) + len(needs), width)
        out: list[int] = []
        r_idx: list[int] = []
        c_idx: list[int] = []
        vals: list[int] = []
        runs: list[tuple[int, int, list[int]]] = []  # (row, first column, slots): long runs
        for req, n in needs:
            ent = self._rows.get(id(req))
            if ent is None:
                if not self._free:
                    self._grow(2 * self.table.shape[0], self.table.shape[1])
                ent = _Row(req, self._free.pop(), 0, req.slots_version)
                self._rows[id(req)] = ent
            elif ent.version != req.slots_version:
                ent.synced, ent.version = 0, req.slots_version
            if n > ent.synced:
                new = req.slots[ent.synced : n]
                if len(new) > 8:
                    runs.append((ent.row, ent.synced, new))
                else:  # a decode's one new slot (or a few): gathered into one indexed write
                    r_idx.extend([ent.row] * len(new))
                    c_idx.extend(range(ent.synced, n))
                    vals.extend(new)
                ent.synced = n
            out.append(ent.row)
        for row, col, slots in runs:
            self.table[row, col : col + len(slots)] = torch.tensor(slots, dtype=torch.int32)
        if vals:
            self.table[torch.tensor(r_idx), torch.tensor(c_idx)] = torch.tensor(vals, dtype=torch.int32)
        return out

    def _reclaim(self) -> None:
        gone = [k for k, e in self._rows.items() if not e.req.slots]
        for k in gone:
            self._free.append(self._rows.pop(k).row)

    def _grow(self, rows: int, width: int) -> None:
        old = self.table
        rows = max(rows, old.shape[0])
        width = min(self.max_len, max(width, old.shape[1]))
        if width > old.shape[1]:
            width = min(self.max_len, max(width, 2 * old.shape[1]))
        new = torch.zeros((rows, width), dtype=torch.int32, device=self.device)
        new[: old.shape[0], : old.shape[1]] = old
        self._free.extend(range(rows - 1, old.shape[0] - 1, -1))
        self.table = new

    def clear(self) -> None:
        self._rows.clear()
        self._free = list(range(self.table.shape[0] - 1, -1, -1))
