"""The slot table mirrors each request's slot list for the kernels: appends copied lazily, any
other edit (signalled by ``slots_version``) rewrites the row, rows reclaimed when a request
lets go of its slots, the table grows as needed. No model."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tripod.memory.slot_table import SlotTable


@dataclass(eq=False)
class FakeReq:
    slots: list[int] = field(default_factory=list)
    slots_version: int = 0


def _row(table: SlotTable, row: int, n: int) -> list[int]:
    return table.table[row, :n].tolist()


def test_appends_and_rewrites() -> None:
    t = SlotTable(max_len=4096, device=torch.device("cpu"), rows=2, width=8)
    a = FakeReq(list(range(100, 140)))
    (ra,) = t.sync([(a, 40)])  # a prefill chunk: a long run, and a growth past width 8
    assert _row(t, ra, 40) == a.slots
    a.slots.append(7)  # a decode's new slot
    assert t.sync([(a, 41)]) == [ra] and _row(t, ra, 41) == a.slots
    # The prefix cache swaps in its own slots for a duplicated prefix: the row is rewritten.
    a.slots[:10] = list(range(900, 910))
    a.slots_version += 1
    t.sync([(a, 41)])
    assert _row(t, ra, 41) == a.slots
    # Draft slots given back, then new ones appended at the same positions.
    del a.slots[38:]
    a.slots_version += 1
    a.slots += [55, 56, 57]
    t.sync([(a, 41)])
    assert _row(t, ra, 41) == a.slots


def test_rows_are_reclaimed_and_reused() -> None:
    t = SlotTable(max_len=64, device=torch.device("cpu"), rows=2, width=4)
    reqs = [FakeReq([i, i + 1]) for i in range(5)]
    rows = t.sync([(r, 2) for r in reqs])  # more requests than rows: the table grows
    assert len(set(rows)) == 5 and t.rows_in_use == 5
    for i, r in enumerate(reqs):
        assert _row(t, rows[i], 2) == r.slots
    reqs[1].slots = []  # finished: released its slots
    reqs[1].slots_version += 1
    new = FakeReq([40, 41, 42])
    (rn,) = t.sync([(new, 3)])
    assert t.rows_in_use == 5 and rn == rows[1], "the freed row is reused"
    assert _row(t, rn, 3) == new.slots


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.sampled_from(["append", "extend", "swap", "trim", "release"])), max_size=60))
def test_table_always_mirrors_the_slot_lists(ops: list[tuple[int, str]]) -> None:
    t = SlotTable(max_len=10_000, device=torch.device("cpu"), rows=1, width=2)
    reqs = [FakeReq() for _ in range(4)]
    counter = iter(range(10**6))
    for i, op in ops:
        r = reqs[i]
        if op == "append":
            r.slots.append(next(counter))
        elif op == "extend":
            r.slots.extend(next(counter) for _ in range(20))
        elif op == "swap" and r.slots:
            r.slots[: len(r.slots) // 2] = [next(counter) for _ in range(len(r.slots) // 2)]
            r.slots_version += 1
        elif op == "trim" and r.slots:
            del r.slots[len(r.slots) // 2 :]
            r.slots_version += 1
        elif op == "release":
            r.slots = []
            r.slots_version += 1
        live = [r for r in reqs if r.slots]
        rows = t.sync([(r, len(r.slots)) for r in live])
        assert len(set(rows)) == len(rows)
        for r, row in zip(live, rows, strict=True):
            assert _row(t, row, len(r.slots)) == r.slots
