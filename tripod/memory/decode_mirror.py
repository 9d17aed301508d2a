"""A dense copy of the decoding requests' KV, so decode attention reads it without a gather.

With page size 1 a request's KV is scattered over the pool, and gathering it for every layer of
every step costs more than the attention itself. The mirror keeps, for each decoding request, a
row of ``[layers, max_len, K|V, kv_heads, head_dim]``: filled once (one gather over all layers)
when the request starts decoding, then appended one token per step as the forward writes it.

Invariants:
- Rows ``0..n-1`` are exactly this step's single-token items, in batch order (the runner lays
  the decode tokens out in row order); a request that stops decoding gives its row back and the
  last row moves into the hole, so rows stay dense.
- ``lens[row]`` tokens of the row are valid copies of the pool; the forward adds one more.
- The pool stays the source of truth: the mirror is rebuilt from it whenever a request is new to
  it or out of step (retracted and readmitted), and dropped when it would exceed its budget.
"""

from __future__ import annotations

from typing import Protocol

import torch

from tripod.memory.kv_pool import KVPool


class Mirrored(Protocol):
    """What the mirror reads of a decoding request (``engine.request.Req``): the KV slots of its
    tokens, in order. A request is known by its identity (``id``)."""

    slots: list[int]


_ROW_STEP = 16
_LEN_STEP = 256


class DecodeMirror:
    """Owns the dense decode buffer and the request → row map."""

    def __init__(self, pool: KVPool, max_bytes: int) -> None:
        self.pool = pool
        self.max_bytes = max_bytes
        layers = pool.kv.shape[0]
        self._row_token_bytes = layers * pool.kv[0, 0].numel() * pool.kv.element_size()
        self.buf: torch.Tensor | None = None  # [layers, rows, len, 2, kv_heads, head_dim]
        self.rows: dict[int, int] = {}  # id(req) -> row
        self.owner: list[Mirrored] = []  # row -> req
        self.lens: list[int] = []  # row -> valid tokens
        self.drops = 0  # times the mirror outgrew its budget (decode fell back to gathering)
        self.refills = 0  # rows rebuilt because a request fell out of step

    @staticmethod
    def _rounded(rows: int, length: int) -> tuple[int, int]:
        return -(-rows // _ROW_STEP) * _ROW_STEP, -(-length // _LEN_STEP) * _LEN_STEP

    def _fits(self, rows: int, length: int) -> bool:
        """Whether the buffer this need would allocate (rounded up) stays within budget."""
        r, n = self._rounded(rows, length)
        return r * n * self._row_token_bytes <= self.max_bytes

    def _ensure(self, rows: int, length: int) -> None:
        if self.buf is not None and self.buf.shape[1] >= rows and self.buf.shape[2] >= length:
            return
        # NOTE: sized to the current need only (never the max of past shapes), so every buffer
        # ever allocated passed _fits and the mirror never exceeds its budget.
        r, n = self._rounded(rows, length)
        kv = self.pool.kv
        new = torch.zeros((kv.shape[0], r, n, *kv.shape[2:]), dtype=kv.dtype, device=kv.device)
        if self.buf is not None and self.owner:
            used, width = len(self.owner), max(self.lens)
            new[:, :used, :width] = self.buf[:, :used, :width]
        self.buf = new

    def drop(self) -> None:
        self.buf = None
        self.rows.clear()
        self.owner.clear()
        self.lens.clear()

    def sync(self, reqs: list[Mirrored], starts: list[int]) -> list[int] | None:
        """Make rows for exactly ``reqs`` (decoding this step, each computing token
        ``starts[i]``). Returns the batch order (indices into ``reqs``, by row), or None when
        the mirror would exceed its budget (the caller gathers from the pool instead)."""
        width = max(starts, default=0) + 1
        if not self._fits(len(reqs), width):
            if self.buf is not None:
                self.drops += 1
            self.drop()
            return None
        keep = {id(r) for r in reqs}
        # Give back rows of requests that stopped decoding (finished, retracted, aborted).
        for row in range(len(self.owner) - 1, -1, -1):
            r = self.owner[row]
            if id(r) not in keep:
                self._remove(row)
        self._ensure(len(reqs), width)
        assert self.buf is not None
        for r, start in zip(reqs, starts, strict=True):
            held = self.rows.get(id(r))
            if held is not None and self.lens[held] != start:
                self._remove(held)  # out of step (e.g. retracted and recomputed): refill
                self.refills += 1
                held = None
            if held is not None:
                row = held
            else:
                row = len(self.owner)
                self.rows[id(r)] = row
                self.owner.append(r)
                self.lens.append(start)
                if start:
                    idx = torch.tensor(r.slots[:start], dtype=torch.long, device=self.buf.device)
                    self.buf[:, row, :start] = self.pool.kv.index_select(1, idx)
            self.lens[row] = start + 1  # the forward writes token `start` into the row
        index = {id(r): i for i, r in enumerate(reqs)}
        return [index[id(r)] for r in self.owner]

    def _remove(self, row: int) -> None:
        assert self.buf is not None
        last = len(self.owner) - 1
        r = self.owner[row]
        del self.rows[id(r)]
        if row != last:
            moved = self.owner[last]
            n = self.lens[last]
            self.buf[:, row, :n] = self.buf[:, last, :n]
            self.owner[row] = moved
            self.lens[row] = n
            self.rows[id(moved)] = row
        self.owner.pop()
        self.lens.pop()
