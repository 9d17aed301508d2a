"""W8A16: a linear over 8-bit signed weight codes with a scale per group of inputs (compressed-tensors
``pack-quantized`` W8A16 and GPTQ 8-bit, symmetric, per group or per channel; NVFP4A16, whose FP4
values arrive as the integers ``2 · e2m1`` in -12..12 with the FP8 group scale times the global
scale, halved), activations bfloat16 / float16 / float32 as they come.

The layout is read once at load from the stored form the CPU path keeps (``loader/stored.group_blocks``'
``Q6_K`` form: per 32 inputs ``[a0 f32, a1 f32, 32 int8 codes]``, ``w = a · q``, ``a0`` / ``a1`` the
scales of inputs 0-15 / 16-31), by ``from_q8_blocks``:

- ``codes`` int8 ``[N, K]`` as stored (K-major rows: the tensor cores' B operand, no copy made);
- ``scales`` float32 ``[G, N]``: one row per group of ``group`` inputs, the largest of 128 / 64 / 32
  / 16 over which the stored scales repeat (per channel: one row).

Weights with zero points (asymmetric GPTQ / compressed-tensors 8-bit) are read from the CPU path's
two 4-bit halves instead (``from_q8_halves``): codes ``q - 128`` and zero points ``z - 128`` per group
(int8 ``[G, N]``), and the kernel forms ``q - z`` (-255..255, exact in every activation dtype).

One program computes a ``BLOCK_M x BLOCK_N`` tile of ``y = x @ (q · s)^T`` the way ``w4a16.py`` does:
per step of ``BLOCK_K`` inputs (inside one group) it converts the codes to the activations' dtype
(integers of at most 8 bits: exact in bf16 / fp16 / fp32), takes their product with ``x`` on the
tensor cores into float32 (IEEE for float32 activations: no TF32), and adds that partial times the
group's scales. The roundings are float32 sums and the final one to the output dtype; ``BLOCK_M``
and the step are chosen by the weight and dtype only, so a row's bits never depend on its batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tripod.kernels.gpu.w4a16 import launch_input

BLOCK_M = 16  # fixed: a row's summation order must not depend on how many rows share its launch
BLOCK_N = 64


def blocks(fp32: bool, group: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K): steps of up to 64 inputs for 16-bit activations, 32 for float32 (whose
    IEEE dot takes half the columns), never past a group (NVFP4's 16); by weight and dtype only."""
    top = 32 if fp32 else 64
    return (BLOCK_N // 2 if fp32 else BLOCK_N), min(top, group)


@dataclass(frozen=True, slots=True)
class PackedW8:
    """One 8-bit weight in the kernel's layout (module docstring); ``perm``: the inputs' order (act-order)."""

    codes: torch.Tensor
    scales: torch.Tensor
    group: int
    n: int
    k: int
    perm: torch.Tensor | None = None
    zeros: torch.Tensor | None = None  # int8 [G, N]: each group's zero point minus 128 (None: symmetric)

    def to(self, device: torch.device) -> PackedW8:
        """The same weight on ``device``."""
        def mv(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return PackedW8(self.codes.to(device), self.scales.to(device), self.group, self.n, self.k, mv(self.perm),
                        mv(self.zeros))

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + self.scales.numel() * 4 + (0 if self.zeros is None else self.zeros.numel())


def from_q8_blocks(blocks: torch.Tensor, n: int, k: int, perm: torch.Tensor | None) -> PackedW8 | None:
    """The layout from an 8-bit weight in the CPU kernels' ``Q6_K`` form (module docstring); None
    where the blocks are not that form's shape."""
    if k % 32 or blocks.dtype != torch.uint8 or tuple(blocks.shape) != (n, k // 32 * 40):
        return None
    per = blocks.reshape(n, k // 32, 40)
    s16 = per[:, :, 0:8].contiguous().view(torch.float32).reshape(n, k // 16)  # [a0, a1] per 32 inputs
    codes = per[:, :, 8:].contiguous().view(torch.int8).reshape(n, k)
    run = 1
    for r in (8, 4, 2):  # 128, 64, 32 inputs a group
        if (k // 16) % r == 0 and bool(torch.all(s16.view(n, -1, r) == s16.view(n, -1, r)[:, :, :1])):
            run = r
            break
    if bool(torch.all(s16 == s16[:, :1])):  # per channel: one group over every input
        return PackedW8(codes, s16[:, :1].t().contiguous(), -(-k // 64) * 64, n, k, perm)
    return PackedW8(codes, s16[:, ::run].t().contiguous(), 16 * run, n, k, perm)


def from_q8_halves(blocks: torch.Tensor, n: int, k: int, perm: torch.Tensor | None) -> PackedW8 | None:
    """The layout from an 8-bit weight with zero points in the CPU kernels' two-halves form
    (``loader/stored.group_blocks``: ``K' = 2K`` inputs, Q4_K-form blocks ``[a, b, nibbles]`` of the
    high nibbles ``h`` with ``a = 16 s, b = 0``, then of the low nibbles ``l`` with ``a = s, b = s z``;
    the gather ``[perm, perm]``): codes ``16 h + l - 128`` and zero points ``z - 128`` as int8, the
    scales ``s``. None where the blocks do not hold exactly that (another Q4_K-form weight)."""
    if k % 32 or blocks.dtype != torch.uint8 or tuple(blocks.shape) != (n, 2 * k // 32 * 24):
        return None
    if perm is None or perm.numel() != 2 * k or not torch.equal(perm[:k], perm[k:]):
        return None
    per = blocks.reshape(n, 2, k // 32, 24)
    a = per[..., 0:4].contiguous().view(torch.float32).reshape(n, 2, -1)
    b = per[..., 4:8].contiguous().view(torch.float32).reshape(n, 2, -1)
    nib = per[..., 8:].to(torch.int32)
    q4 = torch.cat((nib & 0xF, nib >> 4), dim=3).reshape(n, 2, k)
    s, zs = a[:, 1], b[:, 1]
    if not (torch.equal(a[:, 0], s * 16) and bool(torch.all(b[:, 0] == 0)) and bool(torch.all(s > 0))):
        return None
    z = torch.round(zs / s)
    if not (bool(torch.all((z >= 0) & (z <= 255))) and torch.equal(s.double() * z.double(), zs.double())):
        return None
    codes = (q4[:, 0] * 16 + q4[:, 1] - 128).to(torch.int8)
    zc = (z - 128).to(torch.int8)
    run = 1
    for r in (4, 2):  # 128, 64 inputs a group
        if (k // 32) % r == 0 and all(bool(torch.all(t.view(n, -1, r) == t.view(n, -1, r)[:, :, :1])) for t in (s, zc)):
            run = r
            break
    keep = None if bool(torch.all(perm[:k] == torch.arange(k, device=perm.device))) else perm[:k].clone()
    return PackedW8(codes, s[:, ::run].t().contiguous(), 32 * run, n, k, keep, zc[:, ::run].t().contiguous())


@triton.jit
def w8a16_kernel(x_ptr, w_ptr, s_ptr, z_ptr, out_ptr, m, n, k, group, x_stride, w_stride, out_stride,
                 HAS_ZEROS: tl.constexpr, FP32_DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``out[rows, cols] = x[rows] @ (q · s)[cols]^T``, float32 accumulation, one rounding at the end."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < m
    col_ok = cols < n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    x_ptrs = x_ptr + rows[:, None] * x_stride + ks[None, :]
    w_ptrs = w_ptr + cols.to(tl.int64)[None, :] * w_stride + ks[:, None]
    for k0 in range(0, k, BLOCK_K):
        k_ok = k0 + ks < k
        x = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        q = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0)
        g = k0 // group
        if HAS_ZEROS:  # q - z in -255..255: exact in bf16 (8 significant bits), fp16 and fp32
            z = tl.load(z_ptr + g * n + cols, mask=col_ok, other=0).to(tl.int32)
            w = (q.to(tl.int32) - z[None, :]).to(x.dtype)
        else:
            w = q.to(x.dtype)  # integers of at most 8 bits: exact in every activation dtype
        s = tl.load(s_ptr + g * n + cols, mask=col_ok, other=0.0)
        if FP32_DOT:
            part = tl.dot(x, w, input_precision="ieee", out_dtype=tl.float32)
        else:
            part = tl.dot(x, w, out_dtype=tl.float32)
        acc += part * s[None, :]
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    tl.store(out_ptr + rows[:, None] * out_stride + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def w8a16_linear(x: torch.Tensor, w: PackedW8) -> torch.Tensor:
    """``x`` ``[M, K]`` (bf16/fp16/fp32, rows may be strided) times the packed weight → ``[M, N]`` in x's dtype."""
    x, out = launch_input(x, w, "W8A16")
    m = x.shape[0]
    if m:
        fp32 = x.dtype == torch.float32
        block_n, block_k = blocks(fp32, w.group)
        grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(w.n, block_n))
        w8a16_kernel[grid](x, w.codes, w.scales, w.zeros if w.zeros is not None else w.codes, out, m, w.n, w.k,
                           w.group, x.stride(0), w.codes.stride(0), out.stride(0), HAS_ZEROS=w.zeros is not None,
                           FP32_DOT=fp32, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k)
    return out
