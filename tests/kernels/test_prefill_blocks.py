"""Prefill attention's blocked path (blocks of queries × transposed 16-key tiles, several query
vectors scored together) on every kernel level this CPU runs, the ``amx_emu`` test level included:
a prompt continued after a cached prefix of several lengths and attended in chunks of several
sizes gives every query row the bits of the same row attended alone (a decode row: the dot form),
and every level gives the same bits as the others (``amx_emu`` runs attention with the
``avx512_bf16`` arithmetic, docs/amx.md).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tripod import kernels
from tripod.kernels import reference
from tripod.kernels.build import AVX_LEVELS, KernelBuild, supported_levels

LEVELS = [lv for lv in supported_levels() if lv in AVX_LEVELS]
if LEVELS and KernelBuild("amx_emu").unsupported_reason() is None:
    LEVELS.append("amx_emu")
pytestmark = pytest.mark.skipif(not LEVELS, reason=f"no kernel level runs here: {kernels.unavailable_reason()}")

HEADS, KVH, D = 9, 3, 64  # the embedded model's shape: 3 query heads folded per KV head
PREFIXES = (0, 19, 519)  # none, mid-tile, past the first 512-key split
CHUNKS = (1, 4, 16, 53)  # a decode-sized step, a verification, a whole block, a block and a tail
NEW = 60  # prompt tokens after the prefix


@pytest.fixture(scope="module")
def levels() -> dict[str, Any]:
    out = {}
    for lv in LEVELS:
        assert kernels.load(lv, wait=True), f"the {lv} kernels must build here: {kernels.unavailable_reason(lv)}"
        out[lv] = kernels.ops(lv)
    return out


def _chunked(ops: Any, q: torch.Tensor, kv: torch.Tensor, table: torch.Tensor, prefix: int, chunk: int) -> torch.Tensor:
    """Rows prefix .. prefix + NEW of row 0 attended chunk by chunk (each chunk reads the keys
    before it back from the pool, as a cached prefix is), a decode row of request 1 alongside."""
    outs = []
    for start in range(0, NEW, chunk):
        m = min(chunk, NEW - start)
        qs = torch.cat([q[NEW : NEW + 1], q[start : start + m]])
        rows = torch.tensor([1] + [0] * m, dtype=torch.int32)
        lens = torch.tensor([77, *range(prefix + start + 1, prefix + start + m + 1)], dtype=torch.int32)
        outs.append(ops.paged_attention(qs, kv, table, rows, lens, D**-0.5)[1:])
    return torch.cat(outs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_blocked_prefill_rows_are_the_rows_alone_at_every_chunk_prefix_and_level(
    levels: dict[str, Any], dtype: torch.dtype
) -> None:
    g = torch.Generator().manual_seed(47)
    width = max(PREFIXES) + NEW + 16
    kv = torch.randn(2 * width, 2, KVH, D, generator=g).to(dtype)
    table = torch.randperm(2 * width, generator=g).view(2, width).to(torch.int32)
    q = torch.randn(NEW + 1, HEADS, D, generator=g).to(dtype)
    zero = torch.zeros(1, dtype=torch.int32)
    base: dict[int, torch.Tensor] = {}  # prefix -> the first level's rows alone
    for lv, ops in levels.items():
        for prefix in PREFIXES:
            alone = torch.stack([
                ops.paged_attention(q[t : t + 1], kv, table, zero, torch.tensor([prefix + t + 1], dtype=torch.int32), D**-0.5)[0]
                for t in range(NEW)
            ])
            for chunk in CHUNKS:
                got = _chunked(ops, q, kv, table, prefix, chunk)
                bad = [t for t in range(NEW) if not torch.equal(got[t], alone[t])]
                assert not bad, f"{lv}, prefix {prefix}, chunks of {chunk}: rows {bad} differ from the rows alone"
            if prefix not in base:
                base[prefix] = alone
                lens = torch.arange(prefix + 1, prefix + NEW + 1, dtype=torch.int32)
                want = reference.paged_attention(q[:NEW], kv, table, torch.zeros(NEW, dtype=torch.int32), lens, D**-0.5)
                tol = 3e-6 if dtype == torch.float32 else 1e-2
                torch.testing.assert_close(alone.float(), want.float(), atol=tol, rtol=tol)
            else:
                assert torch.equal(alone, base[prefix]), f"{lv}, prefix {prefix}: differs from {LEVELS[0]}"


def _reference64(q: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor, lens: list[int], scale: float) -> torch.Tensor:
    """Causal attention of rows ``q`` over ``kv[slots]`` in float64 (row t sees lens[t] keys)."""
    group = q.shape[1] // kv.shape[2]
    k = kv[slots.long(), 0].double().repeat_interleave(group, dim=1)  # [L, H, D]
    v = kv[slots.long(), 1].double().repeat_interleave(group, dim=1)
    out = []
    for t, n in enumerate(lens):
        s = torch.einsum("hd,lhd->hl", q[t].double(), k[:n]) * scale
        out.append(torch.einsum("hl,lhd->hd", torch.softmax(s, dim=-1), v[:n]))
    return torch.stack(out)


# (heads, KV heads, head_dim): lane groups of query rows that are full, partial and several per block.
SHAPES = [(4, 1, 32), (8, 2, 128), (6, 3, 96)]


@pytest.mark.parametrize("shape", SHAPES, ids=[f"{h}x{k}x{d}" for h, k, d in SHAPES])
def test_lane_blocked_bf16_rows_equal_alone_batched_chunked_and_cached(
    levels: dict[str, Any], shape: tuple[int, int, int]
) -> None:
    """The bf16 blocked path (queries and their GQA heads in vector lanes) gives each row the bits
    of the row attended alone, whatever shares its block: other requests in the batch, chunks of
    odd sizes, a cached prefix read back from the pool (past a 512-key split too); and it stays
    within bf16 rounding of a float64 reference."""
    heads, kvh, d = shape
    new, scale = 41, d**-0.5
    g = torch.Generator().manual_seed(heads * d)
    width = 530 + new + 8
    kv = torch.randn(2 * width, 2, kvh, d, generator=g).to(torch.bfloat16)
    table = torch.randperm(2 * width, generator=g).view(2, width).to(torch.int32)
    q = torch.randn(new + 3, heads, d, generator=g).to(torch.bfloat16)
    base: dict[int, torch.Tensor] = {}
    for lv, ops in levels.items():
        for prefix in (0, 13, 530):
            alone = torch.stack([
                ops.paged_attention(q[t : t + 1], kv, table, torch.zeros(1, dtype=torch.int32),
                                    torch.tensor([prefix + t + 1], dtype=torch.int32), scale)[0]
                for t in range(new)
            ])
            for chunk in (7, 23, new):
                outs = []
                for start in range(0, new, chunk):
                    m = min(chunk, new - start)
                    # request 1's three rows (a short block of their own) before and after the chunk
                    qs = torch.cat([q[new : new + 2], q[start : start + m], q[new + 2 : new + 3]])
                    rows = torch.tensor([1, 1] + [0] * m + [1], dtype=torch.int32)
                    lens = torch.tensor([60, 61, *range(prefix + start + 1, prefix + start + m + 1), 90], dtype=torch.int32)
                    outs.append(ops.paged_attention(qs, kv, table, rows, lens, scale)[2 : 2 + m])
                got = torch.cat(outs)
                bad = [t for t in range(new) if not torch.equal(got[t], alone[t])]
                assert not bad, f"{lv}, {shape}, prefix {prefix}, chunks of {chunk}: rows {bad} differ from the rows alone"
            if prefix in base:
                assert torch.equal(alone, base[prefix]), f"{lv}, prefix {prefix}: differs from {LEVELS[0]}"
                continue
            base[prefix] = alone
            want = _reference64(q[:new], kv, table[0], list(range(prefix + 1, prefix + new + 1)), scale)
            torch.testing.assert_close(alone.double(), want, atol=2e-2, rtol=2e-2)
