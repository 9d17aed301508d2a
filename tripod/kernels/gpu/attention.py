"""Paged attention over tripod's slot table, for a ragged batch of every kind of work at once.

Query token ``t`` attends keys ``table[rows[t], j]`` for ``j`` in ``[lo_t, lens[t])`` (``lens`` =
position + 1; ``lo_t`` = ``lens[t] - window`` with a sliding window, else 0): decode rows,
chunked-prefill rows after a prefix-cache hit, and speculative verify rows are the same thing.
Tokens come in *query blocks* of up to ``BLOCK_M`` consecutive tokens of one request (a decode
is a block of one); a program takes one block and one KV head, with the ``G`` query heads that
share that KV head packed as rows of one matrix (``BLOCK_M × BLOCK_G`` rows), so each key block
is loaded once for all of them.

Split-KV (flash-decoding): the keys are cut into splits of ``split_keys`` at fixed absolute
positions; each split's programs keep an online softmax (running max, sum, accumulator) and a
combine kernel merges the splits in a fixed order. The cut depends only on the key positions, so
a token's result is the same alone, batched, chunked or cached (no batch-dependent split count).

Soft-capped logits (``cap * tanh(s / cap)``) and attention sinks (a per-head logit joining the
softmax's denominator) are applied as the torch path applies them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

NEG = tl.constexpr(-1.0e30)  # the running max's start: finite, so a split with no visible key stays NaN-free


@triton.jit
def softmax_step(s, v, m_i, l_i, acc, FP32_DOT: tl.constexpr):
    """One key block of an online softmax: rows' scores ``s`` (masked keys at -inf) over values
    ``v``, folded into the running max ``m_i``, sum ``l_i`` and accumulator ``acc``."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if FP32_DOT:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def paged_attention_kernel(
    q_ptr, kv_ptr, table_ptr, rows_ptr, lens_ptr, blocks_ptr, out_ptr, acc_ptr, ml_ptr, sinks_ptr,
    q_stride, table_stride, scale, softcap, window, split_keys,
    NH: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr, G: tl.constexpr, SPLITS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr, FP32_DOT: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    first = tl.load(blocks_ptr + 2 * b)
    count = tl.load(blocks_ptr + 2 * b + 1)
    r = tl.arange(0, BLOCK_M * BLOCK_G)
    tok_in = r // BLOCK_G
    g = r % BLOCK_G
    live = (tok_in < count) & (g < G)
    tok = (first + tl.where(tok_in < count, tok_in, 0)).to(tl.int64)
    head = kvh * G + g
    d = tl.arange(0, BLOCK_D)
    q = tl.load(q_ptr + tok[:, None] * q_stride + head[:, None] * D + d[None, :],
                mask=live[:, None] & (d[None, :] < D), other=0.0)
    n_keys = tl.load(lens_ptr + tok, mask=live, other=0)
    lo = tl.zeros_like(n_keys)
    if WINDOW:
        lo = tl.maximum(n_keys - window, 0)
    # The block's key range (its tokens are one request's, positions ascending): first token's lo
    # to the last token's len, cut to this split, its start aligned to absolute key blocks.
    hi = tl.load(lens_ptr + first + count - 1)
    lo_b = 0
    if WINDOW:
        lo_b = tl.maximum(tl.load(lens_ptr + first) - window, 0)
    s_lo = tl.maximum(split * split_keys, (lo_b // BLOCK_N) * BLOCK_N)
    s_hi = tl.minimum((split + 1) * split_keys, hi)
    row = tl.load(rows_ptr + first).to(tl.int64)
    m_i = tl.zeros([BLOCK_M * BLOCK_G], dtype=tl.float32) + NEG
    l_i = tl.zeros([BLOCK_M * BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M * BLOCK_G, BLOCK_D], dtype=tl.float32)
    for start in range(s_lo, s_hi, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        in_range = j < s_hi
        slot = tl.load(table_ptr + row * table_stride + j, mask=in_range, other=0).to(tl.int64)
        kp = kv_ptr + slot[:, None] * (2 * NKV * D) + kvh * D + d[None, :]
        kmask = in_range[:, None] & (d[None, :] < D)
        k = tl.load(kp, mask=kmask, other=0.0)
        v = tl.load(kp + NKV * D, mask=kmask, other=0.0)
        if FP32_DOT:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale
        if SOFTCAP:
            s = softcap * (2.0 / (1.0 + tl.exp(-2.0 * s / softcap)) - 1.0)
        seen = (j[None, :] < n_keys[:, None]) & (j[None, :] >= lo[:, None]) & in_range[None, :]
        m_i, l_i, acc = softmax_step(tl.where(seen, s, float("-inf")), v, m_i, l_i, acc, FP32_DOT)
    dmask = live[:, None] & (d[None, :] < D)
    if SPLITS == 1:
        if HAS_SINKS:
            sink = tl.load(sinks_ptr + head, mask=live, other=0.0).to(tl.float32)
            m_all = tl.maximum(m_i, sink)
            keep = tl.exp(m_i - m_all)
            l_i = l_i * keep + tl.exp(sink - m_all)
            acc = acc * keep[:, None]
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + tok[:, None] * (NH * D) + head[:, None] * D + d[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=dmask)
    else:
        at = (tok * NH + head) * SPLITS + split
        tl.store(acc_ptr + at[:, None] * D + d[None, :], acc, mask=dmask)
        tl.store(ml_ptr + 2 * at, m_i, mask=live)
        tl.store(ml_ptr + 2 * at + 1, l_i, mask=live)


@triton.jit
def combine_splits_kernel(acc_ptr, ml_ptr, out_ptr, sinks_ptr, NH: tl.constexpr, D: tl.constexpr,
                          SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
                          HAS_SINKS: tl.constexpr):
    """One (token, head): the splits' partial softmaxes merged, always in the same order."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    at = (t * NH + h) * SPLITS + s
    m = tl.load(ml_ptr + 2 * at, mask=s < SPLITS, other=NEG)
    l_s = tl.load(ml_ptr + 2 * at + 1, mask=s < SPLITS, other=0.0)
    a = tl.load(acc_ptr + at[:, None] * D + d[None, :], mask=(s[:, None] < SPLITS) & (d[None, :] < D), other=0.0)
    m_all = tl.max(m, axis=0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + h).to(tl.float32)
        m_all = tl.maximum(m_all, sink)
    w = tl.exp(m - m_all)
    total = tl.sum(l_s * w, axis=0)
    if HAS_SINKS:
        total += tl.exp(sink - m_all)
    o = tl.sum(a * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + t * (NH * D) + h * D + d, o.to(out_ptr.dtype.element_ty), mask=d < D)


def query_blocks(starts: list[int], counts: list[int], block_m: int) -> list[int]:
    """The flat ``(first token, tokens)`` pairs of ``block_m``-token query blocks, each item's run
    of ``counts[i]`` tokens from flat row ``starts[i]`` cut into blocks."""
    out: list[int] = []
    for s, n in zip(starts, counts, strict=True):
        for b in range(s, s + n, block_m):
            out += [b, min(block_m, s + n - b)]
    return out


def tile(group: int, many: bool) -> tuple[int, int]:
    """``(BLOCK_M, BLOCK_G)`` for ``group`` query heads per KV head: at least 16 rows (the tensor
    cores' smallest tile); ``many``: blocks of several tokens (prefill chunks) get 64 rows."""
    bg = triton.next_power_of_2(group)
    rows = 64 if many else 16
    return max(rows // bg, 1), bg


def paged_attention(q: torch.Tensor, kv: torch.Tensor, table: torch.Tensor, rows: torch.Tensor, lens: torch.Tensor,
                    blocks: torch.Tensor, block_m: int, scale: float, *, split_keys: int, splits: int,
                    window: int | None = None, softcap: float | None = None,
                    sinks: torch.Tensor | None = None, block_n: int | None = None) -> torch.Tensor:
    """``q`` ``[T, NH, D]`` (rows may be strided) over the layer's pool ``kv`` ``[S, 2, NKV, D]``
    → ``[T, NH, D]``. ``blocks`` ``[NB, 2]`` int32 (from ``query_blocks`` with ``block_m``);
    ``splits`` = ``ceil(table width / split_keys)`` (fixed for a table, so never batch-dependent);
    ``split_keys`` a multiple of ``block_n`` (keys per inner step), so key blocks sit at absolute
    positions."""
    t, nh, d = q.shape
    bn = block_n or keys_per_step(d)
    assert split_keys % bn == 0, f"split_keys ({split_keys}) must be a multiple of the key block ({bn})"
    assert splits * split_keys >= table.shape[1], "the splits must cover the table's width"
    nkv = kv.shape[2]
    assert q.stride(2) == 1 and q.stride(1) == d and kv.is_contiguous() and table.stride(1) == 1
    group = nh // nkv
    bm, bg = block_m, triton.next_power_of_2(group)
    out = torch.empty((t, nh, d), dtype=q.dtype, device=q.device)
    nb = blocks.shape[0]
    if t == 0 or nb == 0:
        return out
    if splits > 1:
        acc = torch.empty((t, nh, splits, d), dtype=torch.float32, device=q.device)
        ml = torch.empty((t, nh, splits, 2), dtype=torch.float32, device=q.device)
    else:
        acc = ml = out  # (unused)
    snk = sinks if sinks is not None else out
    paged_attention_kernel[(nb, nkv, splits)](
        q, kv, table, rows, lens, blocks, out, acc, ml, snk, q.stride(0), table.stride(0), scale,
        softcap or 0.0, window or 0, split_keys, NH=nh, NKV=nkv, D=d, G=group, SPLITS=splits, BLOCK_M=bm, BLOCK_G=bg,
        BLOCK_N=bn, BLOCK_D=triton.next_power_of_2(d), SOFTCAP=softcap is not None, WINDOW=window is not None,
        HAS_SINKS=sinks is not None, FP32_DOT=q.dtype == torch.float32, num_warps=NUM_WARPS,
    )
    if splits > 1:
        combine_splits_kernel[(t, nh)](acc, ml, out, snk, NH=nh, D=d, SPLITS=splits,
                                       BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=triton.next_power_of_2(d),
                                       HAS_SINKS=sinks is not None)
    return out


def keys_per_step(d: int) -> int:
    """Keys per inner step, for every query block of a model alike (a token's softmax then runs
    over the same key blocks whatever block it is in): 32, or 16 for 256-wide heads, which with
    8 warps compiles for sm_90 without register spills (``python -m tripod.kernels.gpu compile``)."""
    return 16 if d >= 256 else 32


NUM_WARPS = 8
