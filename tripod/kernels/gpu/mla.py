"""MLA's absorbed decode over the latent pool (DeepSeek-V2/V3: a 512-value latent and a 64-value
shared rope key per token and layer).

Each decode row's query is already in latent space (``q_nope · W_UK`` beside the rotated
``q_pe``): its score against a cached token is ``q_lat · c + q_pe · k_pe``, and its output (still
latent, ``W_UV`` is applied after) the softmax-weighted sum of the latents ``c`` themselves, so the
pool is read once per token for all heads. A program takes one row, ``BLOCK_H`` heads and one
split of the keys; the splits merge in ``attention.combine_splits_kernel`` (fixed order).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tripod.kernels.gpu.attention import NEG, combine_splits_kernel, softmax_step


@triton.jit
def mla_decode_kernel(q_ptr, lat_ptr, idx_ptr, lens_ptr, out_ptr, acc_ptr, ml_ptr, idx_stride, lat_stride,
                      scale, split_keys, H: tl.constexpr, R: tl.constexpr, P: tl.constexpr, SPLITS: tl.constexpr,
                      BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
                      FP32_DOT: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    hm = h < H
    r = tl.arange(0, BLOCK_R)
    p = tl.arange(0, BLOCK_P)
    qrow = q_ptr + b * (H * (R + P)) + h[:, None] * (R + P)
    q_lat = tl.load(qrow + r[None, :], mask=hm[:, None] & (r[None, :] < R), other=0.0)
    q_pe = tl.load(qrow + R + p[None, :], mask=hm[:, None] & (p[None, :] < P), other=0.0)
    n = tl.load(lens_ptr + b)
    s_lo = split * split_keys
    s_hi = tl.minimum(s_lo + split_keys, n)
    m_i = tl.zeros([BLOCK_H], dtype=tl.float32) + NEG
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], dtype=tl.float32)
    for start in range(s_lo, s_hi, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        inside = j < s_hi
        slot = tl.load(idx_ptr + b * idx_stride + j, mask=inside, other=0).to(tl.int64)
        rowp = lat_ptr + slot[:, None] * lat_stride
        c = tl.load(rowp + r[None, :], mask=inside[:, None] & (r[None, :] < R), other=0.0)
        k_pe = tl.load(rowp + R + p[None, :], mask=inside[:, None] & (p[None, :] < P), other=0.0)
        if FP32_DOT:
            s = tl.dot(q_lat, tl.trans(c), input_precision="ieee") + tl.dot(q_pe, tl.trans(k_pe), input_precision="ieee")
        else:
            s = tl.dot(q_lat, tl.trans(c)) + tl.dot(q_pe, tl.trans(k_pe))
        m_i, l_i, acc = softmax_step(tl.where(inside[None, :], s * scale, float("-inf")), c, m_i, l_i, acc, FP32_DOT)
    om = hm[:, None] & (r[None, :] < R)
    if SPLITS == 1:
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + b * (H * R) + h[:, None] * R + r[None, :], o.to(out_ptr.dtype.element_ty), mask=om)
    else:
        at = (b * H + h) * SPLITS + split
        tl.store(acc_ptr + at[:, None] * R + r[None, :], acc, mask=om)
        tl.store(ml_ptr + 2 * at, m_i, mask=hm)
        tl.store(ml_ptr + 2 * at + 1, l_i, mask=hm)


def mla_decode(q: torch.Tensor, lat: torch.Tensor, idx: torch.Tensor, lens: torch.Tensor, rank: int, scale: float,
               *, split_keys: int, splits: int) -> torch.Tensor:
    """Decode rows ``q`` ``[B, H, rank + rope]`` (latent query ‖ rotated rope query) over the
    layer's latent pool ``lat`` ``[S, row]`` (a row's first ``rank + rope`` values: latent, rope
    key), row ``b`` attending ``idx[b, :lens[b]]`` → ``[B, H, rank]`` (latent-space output)."""
    bsz, nh, width = q.shape
    rope = width - rank
    assert q.is_contiguous() and lat.stride(1) == 1 and idx.stride(1) == 1
    out = torch.empty((bsz, nh, rank), dtype=q.dtype, device=q.device)
    if bsz == 0:
        return out
    if splits > 1:
        acc = torch.empty((bsz, nh, splits, rank), dtype=torch.float32, device=q.device)
        ml = torch.empty((bsz, nh, splits, 2), dtype=torch.float32, device=q.device)
    else:
        acc = ml = out
    block_h = 16
    block_r = triton.next_power_of_2(rank)
    block_n = 16 if block_r >= 512 else 32
    assert split_keys % block_n == 0, f"split_keys ({split_keys}) must be a multiple of {block_n}"
    assert splits * split_keys >= idx.shape[1], "the splits must cover the index table's width"
    mla_decode_kernel[(bsz, triton.cdiv(nh, block_h), splits)](
        q, lat, idx, lens, out, acc, ml, idx.stride(0), lat.stride(0), scale, split_keys, H=nh, R=rank, P=rope,
        SPLITS=splits, BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_R=block_r, BLOCK_P=max(16, triton.next_power_of_2(rope)),
        FP32_DOT=q.dtype == torch.float32)
    if splits > 1:
        combine_splits_kernel[(bsz, nh)](acc, ml, out, out, NH=nh, D=rank, SPLITS=splits,
                                         BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=block_r, HAS_SINKS=False)
    return out
