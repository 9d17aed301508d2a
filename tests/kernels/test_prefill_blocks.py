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
