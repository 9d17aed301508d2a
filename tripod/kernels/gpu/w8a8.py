"""W8A8 INT8: the exact product of int8 activation codes and int8 weight codes (compressed-tensors
``int-quantized``), ``acc[m, n] = Σ_k qx[m, k] · qw[n, k]`` in int32 on the tensor cores.

The activations are quantized before the launch by the CPU path's own functions
(``layers/w8a8.quantize_per_token`` / ``quantize_static``, torch ops on the device), and the
epilogue after it is the CPU path's too (``acc · (s_x · s_w)`` in float64, one rounding to the run
dtype, then the bias): the kernel only replaces ``torch._int_mm``. Each code product is at most
``128 · 128 = 2^14`` in magnitude, so an int32 sum of fewer than ``2^17`` of them is exact whatever
its order: the integer accumulator holds the same value as the CPU path's, the result the same bits,
and a row's value never depends on its batch (``BLOCK_M`` is fixed anyway, as in ``w4a16.py``).

The weight codes stay as stored, int8 ``[N, K]`` row-major (K-major for the tensor cores' B operand:
no copy). FP8 W8A8 is not here: Triton's FP8 dot accumulates in float32, which cannot hold the CPU
path's exact sums (FP8 products are multiples of 2^-18 up to 2^18), so its bits would differ.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 16  # fixed: the tile never depends on the row count
BLOCK_N = 64
BLOCK_K = 64  # int8 tensor-core steps take 32 inputs or more
MAX_EXACT_K = 2**17  # |qx · qw| <= 2^14: fewer than 2^17 products sum exactly in int32


@triton.jit
def w8a8_int8_kernel(x_ptr, w_ptr, out_ptr, m, n, k, x_stride, w_stride, out_stride,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``out[rows, cols] = qx[rows] @ qw[cols]^T``, int8 × int8 → int32 (exact)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < m
    col_ok = cols < n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    x_ptrs = x_ptr + rows[:, None] * x_stride + ks[None, :]  # (pointers advanced per step: fewer registers)
    w_ptrs = w_ptr + cols[None, :] * w_stride + ks[:, None]
    for k0 in range(0, k, BLOCK_K):
        k_ok = k0 + ks < k
        x = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0)
        acc += tl.dot(x, w, out_dtype=tl.int32)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    tl.store(out_ptr + rows[:, None] * out_stride + cols[None, :], acc, mask=row_ok[:, None] & col_ok[None, :])


def int8_product(q: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """``q`` int8 ``[M, K]`` times ``codes`` int8 ``[N, K]`` (rows may be strided) → int32 ``[M, N]``,
    exactly ``Σ_k q[m, k] · codes[n, k]``. Raises ValueError where int32 could overflow."""
    if q.dtype != torch.int8 or codes.dtype != torch.int8:
        raise ValueError(f"the W8A8 INT8 kernel takes int8 codes, not {q.dtype} x {codes.dtype}")
    m, k = q.shape
    n = codes.shape[0]
    if codes.shape[1] != k:
        raise ValueError(f"W8A8 linear: input has {k} features, the weight expects {codes.shape[1]}")
    if k >= MAX_EXACT_K:
        raise ValueError(f"W8A8 INT8 on Triton sums in int32, exact below {MAX_EXACT_K} inputs; this weight has {k}")
    if q.stride(1) != 1:
        q = q.contiguous()
    if codes.stride(1) != 1:
        codes = codes.contiguous()
    out = torch.empty((m, n), dtype=torch.int32, device=q.device)
    if m and n:
        grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
        w8a8_int8_kernel[grid](q, codes, out, m, n, k, q.stride(0), codes.stride(0), out.stride(0),
                               BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return out
