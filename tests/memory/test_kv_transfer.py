"""KV blocks between processes (``memory/kv_transfer.py``), no model: the wire bytes are the disk
tier's file bytes; the receiver verifies the chain from its own identity, refuses another model or
layout, and a stream cut part-way publishes only whole blocks of a prefix."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tripod.memory.disk_tier import DiskTier
from tripod.memory.kv_blocks import (
    HEADER,
    OLD_HEADER,
    TierLayout,
    chain_keys,
    check_block,
    encode_block,
    snapshot_key,
)
from tripod.memory.kv_transfer import BlockReceiver, TransferRefused

B = 4
IDENT = bytes(range(16))
OTHER = bytes(range(1, 17))
TOKENS = list(range(100, 100 + 5 * B + 2))  # five whole blocks and two tokens more


def _layout(identity: bytes = IDENT, row: tuple[int, ...] = (2, 2, 5)) -> TierLayout:
    return TierLayout(identity, num_layers=3, row_shape=row, dtype=torch.float32, block_tokens=B)


def _rows(seed: int, lay: TierLayout) -> torch.Tensor:
    return torch.randn(lay.shape, generator=torch.Generator().manual_seed(seed))


def _stream(lay: TierLayout, tokens: list[int] = TOKENS) -> list[bytes]:
    keys = chain_keys(lay.identity, tokens, B)
    return [encode_block(lay, k, tokens[j * B : (j + 1) * B], _rows(j, lay)) for j, k in enumerate(keys)]


def test_a_block_on_the_wire_is_the_disk_tiers_file(tmp_path: Path) -> None:
    lay = _layout()
    tier = DiskTier(tmp_path, 100 * lay.file_bytes, lay)
    keys = chain_keys(IDENT, TOKENS, B)
    assert tier.submit(keys[0], TOKENS[:B], _rows(0, lay))
    assert tier.flush(10)
    assert tier.path(keys[0]).read_bytes() == _stream(lay)[0]
    tier.close()


def test_a_stream_in_any_chunks_lands_as_readable_blocks(tmp_path: Path) -> None:
    lay = _layout()
    tier = DiskTier(tmp_path, 100 * lay.file_bytes, lay)
    data = b"".join(_stream(lay))
    rx = BlockReceiver(lay, tier.dir)
    for at in range(0, len(data), 777):  # chunks that cut headers and payloads anywhere
        rx.feed(data[at : at + 777])
    assert (rx.counts.blocks, rx.counts.published, rx.leftover) == (5, 5, 0)
    keys = chain_keys(IDENT, TOKENS, B)
    assert tier.count_present(keys) == 5
    got = tier.read(keys, [TOKENS[j * B : (j + 1) * B] for j in range(5)])
    assert all(torch.equal(g, _rows(j, lay)) for j, g in enumerate(got))
    again = BlockReceiver(lay, tier.dir)
    again.feed(data)
    assert (again.counts.blocks, again.counts.published) == (5, 0), "blocks already there are not rewritten"
    tier.close()


def test_a_cut_stream_publishes_only_whole_blocks(tmp_path: Path) -> None:
    lay = _layout()
    blocks = _stream(lay)
    rx = BlockReceiver(lay, tmp_path)
    rx.feed(b"".join(blocks[:2]) + blocks[2][: len(blocks[2]) // 2])
    assert rx.counts.blocks == 2 and rx.leftover == len(blocks[2]) // 2
    assert len(list(tmp_path.glob("??/*.kv"))) == 2 and not list((tmp_path / "tmp").iterdir())


@pytest.mark.parametrize("sender, status, words", [
    (_layout(OTHER), 409, "identity"),
    (_layout(row=(2, 2, 6)), 409, "blocks are"),
])
def test_another_model_or_layout_is_refused(tmp_path: Path, sender: TierLayout, status: int, words: str) -> None:
    rx = BlockReceiver(_layout(), tmp_path)
    with pytest.raises(TransferRefused, match=words) as e:
        rx.feed(_stream(sender)[0])
    assert e.value.status == status and not list(tmp_path.glob("??/*.kv"))


def test_blocks_out_of_order_or_corrupted_are_refused(tmp_path: Path) -> None:
    lay = _layout()
    blocks = _stream(lay)
    rx = BlockReceiver(lay, tmp_path)
    with pytest.raises(TransferRefused, match="neither continues") as e:
        rx.feed(blocks[1])  # a block whose prefix was not sent
    assert e.value.status == 400
    bad = bytearray(blocks[0])
    bad[-1] ^= 0xFF
    with pytest.raises(TransferRefused, match="checksum"):
        BlockReceiver(lay, tmp_path).feed(bytes(bad))
    assert not list(tmp_path.glob("??/*.kv"))


def test_several_prompts_in_one_stream_each_start_their_chain(tmp_path: Path) -> None:
    lay = _layout()
    other = list(range(500, 500 + 2 * B))
    rx = BlockReceiver(lay, tmp_path)
    rx.feed(b"".join(_stream(lay)[:3] + _stream(lay, other)))
    assert rx.counts.blocks == 5 and len(list(tmp_path.glob("??/*.kv"))) == 5


def test_received_blocks_count_against_the_tiers_capacity(tmp_path: Path) -> None:
    """A decode replica's engine may never write (what its pool evicts came by transfer, so it is on
    disk already): finding received files still keeps the directory under the capacity."""
    lay = _layout()
    tier = DiskTier(tmp_path, 3 * lay.file_bytes, lay)
    rx = BlockReceiver(lay, tier.dir)
    rx.feed(b"".join(_stream(lay)))  # five blocks into a tier of three
    keys = chain_keys(IDENT, TOKENS, B)
    assert tier.count_present(keys) == 5  # all there when looked for ...
    assert tier.used_bytes <= tier.capacity_bytes and len(list(tier.dir.glob("??/*.kv"))) <= 3  # ... then trimmed
    tier.close()


def _snapshot(lay: TierLayout, tokens: list[int], seed: int = 9) -> tuple[bytes, list[int], torch.Tensor, torch.Tensor]:
    """The snapshot block after ``tokens`` (its tail: the tokens past the last whole block)."""
    j = len(tokens) // B
    tail = tokens[j * B :]
    prev = chain_keys(lay.identity, tokens, B)[-1] if j else lay.identity
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(lay.tail_shape(len(tail)), generator=g)
    state = torch.randn(lay.state_bytes // 4, generator=g)
    return snapshot_key(prev, tail), tail, rows, state


def test_a_snapshot_block_travels_after_its_blocks_and_reads_back(tmp_path: Path) -> None:
    lay = replace(_layout(), state_bytes=4 * 24)
    key, tail, rows, state = _snapshot(lay, TOKENS)
    snap = encode_block(lay, key, tail, rows, state)
    assert len(snap) == lay.snapshot_file_bytes(len(tail)) and check_block(lay, snap, key, tail, snapshot=True) is None
    assert check_block(lay, snap, key, tail) is not None, "a snapshot block never answers as a KV block"
    tier = DiskTier(tmp_path, 100 * lay.file_bytes, lay)
    rx = BlockReceiver(lay, tier.dir)
    rx.feed(b"".join([*_stream(lay), snap]))
    assert rx.counts.blocks == 6 and rx.leftover == 0
    assert tier.has_snapshot(key, probe=True) and tier.path(key).suffix == ".st"
    got = tier.read_snapshot(key, tail)
    assert got is not None and torch.equal(got[0], rows) and torch.equal(got[1], state)
    assert tier.read_snapshot(key, [t + 1 for t in tail]) is None  # other tokens: refused (and removed)
    with pytest.raises(TransferRefused, match="does not follow"):
        BlockReceiver(lay, tier.dir).feed(b"".join([*_stream(lay)[:2], snap]))
    tier.close()


def test_an_older_format_is_refused_by_the_tier_and_the_receiver(tmp_path: Path) -> None:
    lay = _layout()
    tier = DiskTier(tmp_path, 100 * lay.file_bytes, lay)
    keys = chain_keys(IDENT, TOKENS, B)
    new = _stream(lay)[0]
    _, ident, key, ntok, nbytes, _, crc = HEADER.unpack_from(new)
    old = OLD_HEADER.pack(b"TPKVBLK2", ident, key, ntok, nbytes, crc) + new[HEADER.size :]  # version 2's file
    with pytest.raises(TransferRefused, match="older block format") as err:
        BlockReceiver(lay, tier.dir).feed(old + b"\0" * HEADER.size)
    assert err.value.status == 409
    tier.path(keys[0]).parent.mkdir(parents=True, exist_ok=True)
    tier.path(keys[0]).write_bytes(old)
    tier.rescan()
    assert tier.read([keys[0]], [TOKENS[:B]]) == [] and tier.counters.old_format_files == 1
    assert not tier.path(keys[0]).exists(), "refused and removed: the next save writes it again"
    assert tier.submit(keys[0], TOKENS[:B], _rows(0, lay)) and tier.flush(10)
    assert tier.path(keys[0]).read_bytes() == new
    tier.close()
