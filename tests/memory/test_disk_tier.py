"""The KV disk tier on its own (no model): keys, atomic files, torn-file detection, identity, LRU
capacity, two tiers on one directory, restarts."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

from tripod.memory.disk_tier import DiskTier
from tripod.memory.kv_blocks import OLD_HEADER, TierLayout, chain_keys

B = 4
IDENT = bytes(range(16))
OTHER = bytes(range(1, 17))


def _layout(identity: bytes = IDENT, dtype: torch.dtype = torch.float32) -> TierLayout:
    return TierLayout(identity, num_layers=3, row_shape=(2, 2, 5), dtype=dtype, block_tokens=B)


def _rows(seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((3, B, 2, 2, 5), generator=g).to(dtype)


def _tier(root: Path, identity: bytes = IDENT, blocks: int = 100, **kw: object) -> DiskTier:
    lay = _layout(identity)
    return DiskTier(root, blocks * lay.file_bytes, lay, **kw)  # type: ignore[arg-type]


def _blocks(tokens: list[int]) -> list[list[int]]:
    return [tokens[i : i + B] for i in range(0, len(tokens) - len(tokens) % B, B)]


def _write(t: DiskTier, tokens: list[int], seed: int = 0) -> list[torch.Tensor]:
    keys = chain_keys(t.layout.identity, tokens, B)
    rows = [_rows(seed + j) for j in range(len(keys))]
    for k, toks, r in zip(keys, _blocks(tokens), rows, strict=True):
        assert t.submit(k, toks, r.clone())
    assert t.flush(10)
    return rows


TOKENS = list(range(100, 112))  # three blocks


def test_chain_keys_name_the_whole_prefix() -> None:
    keys = chain_keys(IDENT, TOKENS, B)
    assert len(keys) == 3 and len(set(keys)) == 3
    assert chain_keys(IDENT, TOKENS[:9], B) == keys[:2], "a partial last block has no key"
    changed = chain_keys(IDENT, [0, *TOKENS[1:]], B)
    assert all(a != b for a, b in zip(changed, keys, strict=True)), "a change in block 0 changes every later key"
    assert chain_keys(OTHER, TOKENS, B)[0] != keys[0], "another identity, other keys"


def test_blocks_round_trip_and_survive_a_restart(tmp_path: Path) -> None:
    t = _tier(tmp_path)
    rows = _write(t, TOKENS)
    keys = chain_keys(IDENT, TOKENS, B)
    assert t.count_present(keys) == 3 and t.counters.written_blocks == 3
    got = t.read(keys, _blocks(TOKENS))
    assert len(got) == 3 and all(torch.equal(a, b) for a, b in zip(got, rows, strict=True))
    t.close()
    again = _tier(tmp_path)  # a restart: the index comes from the directory
    assert again.entries == 3 and again.count_present(keys) == 3
    got = again.read(keys, _blocks(TOKENS))
    assert all(torch.equal(a, b) for a, b in zip(got, rows, strict=True))
    assert not list((again.dir / "tmp").iterdir()), "nothing left half-written"
    again.close()


def test_bfloat16_rows_keep_their_bits(tmp_path: Path) -> None:
    lay = _layout(dtype=torch.bfloat16)
    t = DiskTier(tmp_path, 10 * lay.file_bytes, lay)
    key = chain_keys(IDENT, TOKENS, B)[0]
    r = _rows(3, torch.bfloat16)
    assert t.submit(key, TOKENS[:B], r.clone()) and t.flush(10)
    t.close()
    t = DiskTier(tmp_path, 10 * lay.file_bytes, lay)
    (got,) = t.read([key], [TOKENS[:B]])
    assert got.dtype == torch.bfloat16 and torch.equal(got, r)
    t.close()


def _corrupt_truncate(p: Path) -> None:
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])


def _corrupt_flip(p: Path) -> None:
    data = bytearray(p.read_bytes())
    data[-7] ^= 0x40
    p.write_bytes(bytes(data))


def _corrupt_header(p: Path) -> None:
    data = bytearray(p.read_bytes())
    data[:8] = b"garbage!"
    p.write_bytes(bytes(data))


def _corrupt_empty(p: Path) -> None:
    p.write_bytes(b"")


@pytest.mark.parametrize("corrupt", [_corrupt_truncate, _corrupt_flip, _corrupt_header, _corrupt_empty])
def test_torn_or_corrupted_files_are_never_served(tmp_path: Path, corrupt: object) -> None:
    t = _tier(tmp_path)
    rows = _write(t, TOKENS)
    keys = chain_keys(IDENT, TOKENS, B)
    corrupt(t.path(keys[1]))  # type: ignore[operator]
    t.close()
    t = _tier(tmp_path)
    got = t.read(keys, _blocks(TOKENS))
    assert len(got) == 1 and torch.equal(got[0], rows[0]), "served up to the bad block, not past it"
    assert t.counters.corrupt_files == 1
    assert not t.path(keys[1]).exists(), "a bad file is removed"
    assert t.count_present(keys) == 1
    t.close()


def test_a_dead_writers_temp_file_is_removed_and_never_read(tmp_path: Path) -> None:
    t = _tier(tmp_path)
    t.close()
    key = chain_keys(IDENT, TOKENS, B)[0]
    # A writer killed mid-write leaves its temp file (pid 2**22 + 1 is above any live pid here).
    torn = t.tmp / f"{key.hex()}.{2**22 + 1}.1.tmp"
    torn.write_bytes(OLD_HEADER.pack(b"TPKVBLK1", IDENT, key, B, 999, 0) + b"\0" * 10)
    mine = t.tmp / f"{key.hex()}.{os.getpid()}.1.tmp"  # a live writer's (this process): kept
    mine.write_bytes(b"x")
    t = _tier(tmp_path)
    assert not torn.exists() and mine.exists()
    assert t.count_present([key]) == 0 and t.read([key], [TOKENS[:B]]) == []
    t.close()


def test_another_identity_never_reads_an_entry(tmp_path: Path) -> None:
    a = _tier(tmp_path, IDENT)
    _write(a, TOKENS)
    a.close()
    b = _tier(tmp_path, OTHER)
    assert b.dir != a.dir and b.entries == 0
    assert b.count_present(chain_keys(OTHER, TOKENS, B)) == 0
    # Even a's file put where b looks (a copied directory, a key collision) is refused by its header.
    key_a = chain_keys(IDENT, TOKENS, B)[0]
    key_b = chain_keys(OTHER, TOKENS, B)[0]
    b.path(key_b).parent.mkdir(exist_ok=True)
    b.path(key_b).write_bytes(a.path(key_a).read_bytes())
    assert b.read([key_b], [TOKENS[:B]]) == [] and b.counters.corrupt_files == 1
    b.close()


def test_a_block_whose_tokens_differ_is_refused(tmp_path: Path) -> None:
    t = _tier(tmp_path)
    _write(t, TOKENS)
    key = chain_keys(IDENT, TOKENS, B)[0]
    assert t.read([key], [[1, 2, 3, 4]]) == [] and t.counters.corrupt_files == 1
    t.close()


def test_capacity_removes_the_least_recently_used(tmp_path: Path) -> None:
    t = _tier(tmp_path, blocks=3)
    seqs = [[1000 * s + i for i in range(B)] for s in range(3)]
    keys = [chain_keys(IDENT, s, B)[0] for s in seqs]
    for s, k in zip(seqs, keys, strict=True):
        assert t.submit(k, s, _rows(0))
        assert t.flush(10)
    assert t.read([keys[0]], [seqs[0]])  # the oldest is used again: now the newest
    new = [9000 + i for i in range(B)]
    new_key = chain_keys(IDENT, new, B)[0]
    assert t.submit(new_key, new, _rows(1)) and t.flush(10)
    assert t.entries == 3 and t.used_bytes <= t.capacity_bytes
    assert not t.path(keys[1]).exists(), "the least recently used went"
    assert t.path(keys[0]).exists() and t.path(keys[2]).exists() and t.path(new_key).exists()
    assert t.counters.evicted_files == 1
    t.close()


def test_two_tiers_on_one_directory_share_entries(tmp_path: Path) -> None:
    a = _tier(tmp_path)
    b = _tier(tmp_path)  # both open before anything is written
    rows = _write(a, TOKENS)
    keys = chain_keys(IDENT, TOKENS, B)
    assert b.count_present(keys) == 3, "b finds a's files on disk"
    got = b.read(keys, _blocks(TOKENS))
    assert all(torch.equal(x, y) for x, y in zip(got, rows, strict=True))
    # b writing the same blocks publishes nothing new (they are there).
    for k, toks, r in zip(keys, _blocks(TOKENS), rows, strict=True):
        assert not b.submit(k, toks, r.clone())
    a.close()
    b.close()


def test_queued_blocks_are_served_before_they_are_written(tmp_path: Path) -> None:
    t = _tier(tmp_path)
    gate = threading.Event()
    publish = t._publish

    def held(w: object) -> int | None:
        gate.wait()
        return publish(w)  # type: ignore[arg-type]

    t._publish = held  # type: ignore[method-assign]
    key = chain_keys(IDENT, TOKENS, B)[0]
    r = _rows(5)
    assert t.submit(key, TOKENS[:B], r.clone())
    assert t.count_present([key]) == 1 and not t.path(key).exists()
    (got,) = t.read([key], [TOKENS[:B]])
    assert torch.equal(got, r)
    gate.set()
    assert t.flush(10) and t.path(key).exists()
    t.close()


def test_prefetched_blocks_are_read_once(tmp_path: Path) -> None:
    t = _tier(tmp_path)
    rows = _write(t, TOKENS)
    t.close()
    t = _tier(tmp_path)
    keys = chain_keys(IDENT, TOKENS, B)
    t.prefetch(keys, _blocks(TOKENS))
    got = t.read(keys, _blocks(TOKENS))  # waits for blocks in flight instead of reading them again
    assert all(torch.equal(x, y) for x, y in zip(got, rows, strict=True))
    assert t.counters.read_blocks == 3
    t.close()


def test_a_full_write_queue_drops_blocks(tmp_path: Path) -> None:
    lay = _layout()
    t = DiskTier(tmp_path, 100 * lay.file_bytes, lay, max_pending_bytes=lay.payload_bytes)
    gate = threading.Event()
    publish = t._publish

    def held(w: object) -> int | None:
        gate.wait()
        return publish(w)  # type: ignore[arg-type]

    t._publish = held  # type: ignore[method-assign]
    keys = chain_keys(IDENT, TOKENS, B)
    assert t.submit(keys[0], TOKENS[:B], _rows(0))
    assert not t.submit(keys[1], TOKENS[B : 2 * B], _rows(1))
    assert t.counters.dropped_blocks == 1
    gate.set()
    t.close()


def test_a_capacity_below_one_block_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="holds not one block"):
        DiskTier(tmp_path, 10, _layout())


_WRITER = """
import sys, torch
from pathlib import Path
from tripod.memory.disk_tier import DiskTier
from tripod.memory.kv_blocks import TierLayout, chain_keys
lay = TierLayout(bytes(range(16)), num_layers=3, row_shape=(2, 2, 5), dtype=torch.float32, block_tokens=4)
t = DiskTier(Path(sys.argv[1]), 10**9, lay)
tokens, announced = [], False
while True:  # an endless growing prefix, one block at a time, until killed
    tokens += [len(tokens) + i for i in range(4)]
    key = chain_keys(lay.identity, tokens, 4)[-1]
    t.submit(key, tokens[-4:], torch.full(lay.shape, float(len(tokens))))
    if len(tokens) == 4 * 50 and not announced:
        t.flush()
        print("written", flush=True)
        announced = True
"""


def test_a_writer_killed_mid_write_leaves_nothing_served_corrupted(tmp_path: Path) -> None:
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "written"
    finally:
        proc.send_signal(signal.SIGKILL)  # mid-write, as far as the writer knows
        proc.wait(30)
    t = _tier(tmp_path, blocks=10**6)
    assert not list(t.tmp.iterdir()), "the dead writer's temp files are gone"
    n = t.entries
    assert n >= 50
    tokens = list(range(4 * (n + 5)))
    keys = chain_keys(IDENT, tokens, B)
    got = t.read(keys, _blocks(tokens))
    assert len(got) == n and t.counters.corrupt_files == 0, "every published block is whole"
    assert all(float(block[0, 0, 0, 0, 0]) == 4 * (j + 1) for j, block in enumerate(got))
    t.close()


def test_a_failed_write_leaves_no_file_and_no_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    from tripod.memory import disk_tier

    def full(src: object, dst: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    t = _tier(tmp_path)
    monkeypatch.setattr(disk_tier.os, "replace", full)
    key = chain_keys(IDENT, TOKENS, B)[0]
    assert t.submit(key, TOKENS[:B], _rows(0))
    assert t.flush(10)
    assert not list(t.tmp.iterdir()) and not t.path(key).exists()
    assert t.count_present([key]) == 0 and t.counters.written_blocks == 0
    t.close()
