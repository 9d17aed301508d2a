"""W4A16: a linear over 4-bit integer weight codes with per-group scales and zero points (AWQ, GPTQ,
compressed-tensors ``pack-quantized`` int4), activations bfloat16 / float16 / float32 as they come.

The layout is made once at load (``pack_w4``) from the loader's unpacked codes
(``loader/hf_quant.GroupQuantized``): act-order inputs are first sorted by group (the permutation
the CPU path uses, ``StoredWeight.perm``: the linear gathers ``x[:, perm]``), then

- ``qweight`` int32 ``[ceil(K / 8), N]``: nibble ``i`` of word ``[r, n]`` is the code of input
  ``8 r + i`` for output ``n`` (eight inputs a word, outputs contiguous: a program's loads of one
  word row are coalesced across its outputs);
- ``scales`` float32 ``[G, N]`` and ``zeros`` uint8 ``[G, N]`` (none when every zero point is the
  symmetric midpoint 8), one row per group of ``group`` inputs (a multiple of 32).

One program computes a ``BLOCK_M x BLOCK_N`` tile of ``y = x @ ((q - z) * s)^T``: per step of
``BLOCK_K`` inputs (which divides the group, so one scale row per step) it forms ``q - z`` as small
integers in the activations' dtype (exact in bf16/fp16/fp32), takes their product with ``x`` on the
tensor cores accumulating in float32 (IEEE float32 products for float32 activations: no TF32), and
adds that partial times the group's scales (the scale epilogue). Every product of a code and an
activation is exact; the only roundings are float32 sums and the final one to the output dtype.
``BLOCK_M`` is fixed (not chosen by the row count), so a row's bits do not depend on its batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

BLOCK_M = 16  # fixed: a row's summation order must not depend on how many rows share its launch
BLOCK_N = 64
SYMMETRIC_ZERO = 8


def blocks(fp32: bool, group: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K): 64 inputs a step for 16-bit activations where the group allows (fewer loop
    trips), else 32; float32's IEEE dot takes half the columns (at 64 x 64 it spills registers on sm_90).
    Chosen by the weight and dtype only, never by the row count."""
    if fp32:
        return BLOCK_N // 2, 32
    return BLOCK_N, 64 if group % 64 == 0 else 32


@dataclass(frozen=True, slots=True)
class PackedW4:
    """One int4 weight in the kernel's layout (module docstring); ``perm``: the inputs' order (act-order)."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    group: int
    n: int
    k: int
    perm: torch.Tensor | None = None

    def to(self, device: torch.device) -> PackedW4:
        """The same weight on ``device``."""
        def mv(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return PackedW4(self.qweight.to(device), self.scales.to(device), mv(self.zeros), self.group, self.n, self.k,
                        mv(self.perm))

    @property
    def nbytes(self) -> int:
        zeros = 0 if self.zeros is None else self.zeros.numel()
        return self.qweight.numel() * 4 + self.scales.numel() * 4 + zeros


def pack_w4(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor) -> PackedW4:
    """The kernel's layout from unpacked codes uint8 ``[N, K]`` (0..15), ``scales`` ``[N, G]``,
    ``zeros`` ``[N, G]`` (unsigned domain) and ``g_idx`` int64 ``[K]`` (each input's group), with
    ``W = (codes - zeros[:, g_idx]) * scales[:, g_idx]``. Raises ValueError for what it cannot run."""
    n, k = codes.shape
    groups = scales.shape[1]
    if codes.numel() and int(codes.max()) > 15:
        raise ValueError("W4A16 needs 4-bit codes (0..15); this weight has wider ones")
    perm = None
    if not bool(torch.all(g_idx[1:] >= g_idx[:-1])):
        perm = torch.argsort(g_idx, stable=True)  # act-order: groups made contiguous, x gathered to match
        codes, g_idx = codes[:, perm], g_idx[perm]
    counts = torch.bincount(g_idx, minlength=groups)
    group = int(counts[0]) if groups > 1 else -(-k // 32) * 32  # per channel: one group covering K
    if groups > 1 and not (bool(torch.all(counts[:-1] == group)) and int(counts[-1]) <= group):
        raise ValueError(f"W4A16 needs equal groups of inputs; this weight's group sizes are {counts.unique().tolist()}")
    if group % 32:
        raise ValueError(f"W4A16 needs a group size that is a multiple of 32, not {group}")
    words = -(-k // 8)
    padded = torch.zeros(n, words * 8, dtype=torch.int32)
    padded[:, :k] = codes.to(torch.int32)
    nibbles = padded.view(n, words, 8) << (4 * torch.arange(8, dtype=torch.int32))
    qweight = nibbles.sum(dim=2, dtype=torch.int64).to(torch.int64)
    qweight = torch.where(qweight >= 2**31, qweight - 2**32, qweight).to(torch.int32).t().contiguous()
    sym = bool(torch.all(zeros == SYMMETRIC_ZERO))
    z = None if sym else zeros.to(torch.uint8).t().contiguous()
    return PackedW4(qweight, scales.to(torch.float32).t().contiguous(), z, group, n, k, perm)


@triton.jit
def w4a16_kernel(x_ptr, q_ptr, s_ptr, z_ptr, out_ptr, m, n, k, group, x_stride, out_stride,
                 HAS_ZEROS: tl.constexpr, FP32_DOT: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``out[rows, cols] = x[rows] @ ((q - z) * s)[cols]^T``, float32 accumulation, one rounding at the end."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    shift = (ks % 8) * 4
    row_ok = rows < m
    col_ok = cols < n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        kk = k0 + ks
        k_ok = kk < k
        x = tl.load(x_ptr + rows[:, None] * x_stride + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        word = tl.load(q_ptr + (kk // 8)[:, None] * n + cols[None, :], mask=k_ok[:, None] & col_ok[None, :], other=0)
        q = (word >> shift[:, None]) & 0xF
        g = k0 // group
        s = tl.load(s_ptr + g * n + cols, mask=col_ok, other=0.0)
        if HAS_ZEROS:
            z = tl.load(z_ptr + g * n + cols, mask=col_ok, other=0).to(tl.int32)
            w = (q - z[None, :]).to(x.dtype)  # small integers: exact in every activation dtype
        else:
            w = (q - 8).to(x.dtype)
        if FP32_DOT:
            part = tl.dot(x, w, input_precision="ieee", out_dtype=tl.float32)
        else:
            part = tl.dot(x, w, out_dtype=tl.float32)
        acc += part * s[None, :]
    tl.store(out_ptr + rows[:, None] * out_stride + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def launch_input(x: torch.Tensor, w: PackedW4 | Any, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A group-quantized linear's activations as its kernel reads them — act-order inputs gathered
    (``x[:, perm]``, exact), unit stride along K — and its output ``[M, N]`` in ``x``'s dtype."""
    if x.shape[1] != w.k:
        raise ValueError(f"{name} linear: input has {x.shape[1]} features, the weight expects {w.k}")
    if w.perm is not None:
        x = x.index_select(1, w.perm)
    if x.stride(1) != 1:
        x = x.contiguous()
    return x, torch.empty((x.shape[0], w.n), dtype=x.dtype, device=x.device)


def w4a16_linear(x: torch.Tensor, w: PackedW4) -> torch.Tensor:
    """``x`` ``[M, K]`` (bf16/fp16/fp32, rows may be strided) times the packed weight → ``[M, N]`` in x's dtype."""
    x, out = launch_input(x, w, "W4A16")
    m = x.shape[0]
    if m:
        fp32 = x.dtype == torch.float32
        block_n, block_k = blocks(fp32, w.group)
        grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(w.n, block_n))
        w4a16_kernel[grid](x, w.qweight, w.scales, w.zeros if w.zeros is not None else w.qweight, out, m, w.n, w.k,
                           w.group, x.stride(0), out.stride(0), HAS_ZEROS=w.zeros is not None,
                           FP32_DOT=fp32, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k)
    return out


def from_group_blocks(blocks: torch.Tensor, n: int, k: int, perm: torch.Tensor | None) -> PackedW4 | None:
    """The layout from an int4 weight in the CPU kernels' Q4_K form (``loader/stored.group_blocks``:
    per 32 inputs ``[a f32, b f32, 16 bytes of nibbles]``, ``w = a q - b``, inputs 0-15 in the low
    nibbles), where it holds ``(q - z) * s`` exactly: ``a = s``, ``b = s z`` with ``z`` an integer
    0..15. None where it does not (a GGUF Q4_K's free minimums): that weight is not W4A16's.
    The largest group (128, 64 or 32 inputs) over which the scales and zero points repeat is kept."""
    if k % 32 or blocks.dtype != torch.uint8 or tuple(blocks.shape) != (n, k // 32 * 24):
        return None
    per = blocks.reshape(n, k // 32, 24)
    a = per[:, :, 0:4].contiguous().view(torch.float32).reshape(n, -1)
    b = per[:, :, 4:8].contiguous().view(torch.float32).reshape(n, -1)
    nib = per[:, :, 8:].to(torch.int32)
    codes = torch.cat((nib & 0xF, nib >> 4), dim=2).reshape(n, k).to(torch.uint8)
    safe = torch.where(a == 0, torch.ones_like(a), a)
    z = torch.where(a == 0, torch.zeros_like(b), torch.round(b / safe))
    if not bool(torch.all((z >= 0) & (z <= 15))) or not torch.equal(a.double() * z.double(), b.double()):
        return None
    blocks32 = k // 32
    for run in (4, 2, 1):  # 128, 64, 32 inputs a group
        if blocks32 % run == 0 and bool(torch.all(a.view(n, -1, run) == a.view(n, -1, run)[:, :, :1])) and bool(
                torch.all(z.view(n, -1, run) == z.view(n, -1, run)[:, :, :1])):
            break
    scales, zeros = a[:, ::run].contiguous(), z[:, ::run].to(torch.int32).contiguous()
    packed = pack_w4(codes, scales, zeros, torch.arange(k) // (32 * run))
    return PackedW4(packed.qweight, packed.scales, packed.zeros, packed.group, n, k, perm)
