"""Row-wise kernels: RMSNorm (optionally adding the residual first), SiLU·mul, and RoPE fused with
the KV write into the pool (the slot-mapping scatter). One program per token row; float32 inside,
one rounding to the tensor's dtype at the end."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, n_cols, x_stride, res_stride, out_stride, eps,
                    HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    """``out = w * x / rms(x)`` per row; ``HAS_RES``: ``x += res`` first, the sum stored to ``sum``."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    keep = cols < n_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=keep, other=0.0).to(tl.float32)
    if HAS_RES:
        x += tl.load(res_ptr + row * res_stride + cols, mask=keep, other=0.0).to(tl.float32)
        tl.store(sum_ptr + row * out_stride + cols, x.to(sum_ptr.dtype.element_ty), mask=keep)
    var = tl.sum(x * x, axis=0) / n_cols
    w = tl.load(w_ptr + cols, mask=keep, other=0.0).to(tl.float32)
    y = w * (x * (1.0 / tl.sqrt(var + eps)))
    tl.store(out_ptr + row * out_stride + cols, y.to(out_ptr.dtype.element_ty), mask=keep)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm of ``x`` ``[T, N]`` (rows may be strided); with ``residual``, of ``x + residual``,
    which is returned too (the next layer's residual)."""
    t, n = x.shape
    assert x.stride(1) == 1 and weight.is_contiguous()
    out = torch.empty((t, n), dtype=x.dtype, device=x.device)
    total = torch.empty_like(out) if residual is not None else None
    if t:
        res = residual if residual is not None else x
        rms_norm_kernel[(t,)](x, res, weight, out, total if total is not None else out, n, x.stride(0), res.stride(0),
                              n, eps, HAS_RES=residual is not None, BLOCK=triton.next_power_of_2(n))
    return out, total


@triton.jit
def silu_mul_kernel(gu_ptr, out_ptr, inter, gu_stride, BLOCK: tl.constexpr):
    """``silu(gate) * up`` of one row of a fused ``[gate | up]`` projection."""
    row = tl.program_id(0).to(tl.int64)
    base = tl.program_id(1) * BLOCK
    cols = base + tl.arange(0, BLOCK)
    keep = cols < inter
    g = tl.load(gu_ptr + row * gu_stride + cols, mask=keep, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * gu_stride + inter + cols, mask=keep, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + row * inter + cols, y.to(out_ptr.dtype.element_ty), mask=keep)


def silu_mul(gu: torch.Tensor, inter: int) -> torch.Tensor:
    """``silu(gu[:, :inter]) * gu[:, inter:]`` → ``[T, inter]``."""
    t = gu.shape[0]
    assert gu.shape[1] == 2 * inter and gu.stride(1) == 1
    out = torch.empty((t, inter), dtype=gu.dtype, device=gu.device)
    block = min(1024, triton.next_power_of_2(inter))
    if t:
        silu_mul_kernel[(t, triton.cdiv(inter, block))](gu, out, inter, gu.stride(0), BLOCK=block)
    return out


@triton.jit
def rope_store_kv_kernel(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, kv_ptr, slot_ptr, qkv_stride, rot_stride,
                         NH: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr,
                         BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_KV: tl.constexpr,
                         BLOCK_D: tl.constexpr):
    """One token: rotate its Q and K heads in place (half-split RoPE), and copy K and V to its pool
    slot ``kv[slot] = [K | V]`` (``[2, NKV, D]``); a slot below zero (a padded row) is not written.
    Every value is loaded once and stored from registers (no program reads what it wrote)."""
    HALF: tl.constexpr = D // 2
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]
    half = tl.arange(0, BLOCK_HALF)[None, :]
    rotated = (heads < NH + NKV) & (half < HALF)
    row = qkv_ptr + t * qkv_stride + heads * D
    x1 = tl.load(row + half, mask=rotated, other=0.0).to(tl.float32)
    x2 = tl.load(row + HALF + half, mask=rotated, other=0.0).to(tl.float32)
    c1 = tl.load(cos_ptr + pos * rot_stride + half, mask=half < HALF, other=0.0)
    c2 = tl.load(cos_ptr + pos * rot_stride + HALF + half, mask=half < HALF, other=0.0)
    s1 = tl.load(sin_ptr + pos * rot_stride + half, mask=half < HALF, other=0.0)
    s2 = tl.load(sin_ptr + pos * rot_stride + HALF + half, mask=half < HALF, other=0.0)
    y1 = (x1 * c1 - x2 * s1).to(qkv_ptr.dtype.element_ty)
    y2 = (x2 * c2 + x1 * s2).to(qkv_ptr.dtype.element_ty)
    tl.store(row + half, y1, mask=rotated)
    tl.store(row + HALF + half, y2, mask=rotated)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        base = kv_ptr + slot * (2 * NKV * D)
        is_k = rotated & (heads >= NH)
        ty = kv_ptr.dtype.element_ty
        tl.store(base + (heads - NH) * D + half, y1.to(ty), mask=is_k)
        tl.store(base + (heads - NH) * D + HALF + half, y2.to(ty), mask=is_k)
        kvh = tl.arange(0, BLOCK_KV)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        inside = (kvh < NKV) & (d < D)
        v = tl.load(qkv_ptr + t * qkv_stride + (NH + NKV + kvh) * D + d, mask=inside, other=0.0)
        tl.store(base + NKV * D + kvh * D + d, v.to(ty), mask=inside)


def rope_store_kv(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  kv: torch.Tensor, slots: torch.Tensor, nh: int, nkv: int) -> None:
    """Rotate Q and K inside ``qkv`` ``[T, (nh + 2 nkv) * D]`` in place by the per-position tables
    ``cos``/``sin`` ``[max_pos, rot]`` (float32, halves duplicated), and write K|V to the layer's
    pool ``kv`` ``[slots, 2, nkv, D]`` at ``slots`` (negative: skipped)."""
    t = qkv.shape[0]
    d = kv.shape[-1]
    rot = cos.shape[1]
    assert qkv.stride(1) == 1 and kv.is_contiguous() and cos.is_contiguous() and sin.is_contiguous()
    assert rot == d, "the kernel rotates whole heads (partial rotary runs on torch's ops)"
    if t:
        rope_store_kv_kernel[(t,)](qkv, positions, cos, sin, kv, slots, qkv.stride(0), rot, NH=nh, NKV=nkv, D=d,
                                   BLOCK_H=triton.next_power_of_2(nh + nkv), BLOCK_HALF=triton.next_power_of_2(d // 2),
                                   BLOCK_KV=triton.next_power_of_2(nkv), BLOCK_D=triton.next_power_of_2(d))
