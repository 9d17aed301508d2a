"""GGUF blocks in the forms tripod's kernels execute as stored (``--weights stored``).

Q4_0, Q4_1 and Q8_0 go to the kernels as the file stores them. The others are rewritten once at load,
keeping exactly the values ``gguf``'s dequantization gives:

- Q5_0 → Q8_0 blocks: the same fp16 scale ``d`` and the 5-bit code minus 16 as int8 (``d * q``).
- Q4_K → per 32 inputs ``[a f32, b f32, 16 bytes of nibbles]`` with ``a = d * sc`` and
  ``b = dmin * m`` (the float32 products gguf forms), codes laid out like Q4_1's (input j < 16: the
  low nibble of byte j; j >= 16: the high nibble of byte j - 16): ``w = a * q - b``.
- Q6_K → per 32 inputs ``[a0 f32, a1 f32, 32 int8 codes]``: ``a = d * sc`` of each 16 inputs and
  the 6-bit code minus 32: ``w = a * q``.

The integer group formats of HF folders (AWQ, GPTQ, compressed-tensors; ``loader/hf_quant.py``) are
rewritten into the Q4_K and Q6_K forms too (``group_blocks``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from tripod.loader.hf_quant import GroupQuantized

QK_K = 256


def convert(kind: str, raw: np.ndarray) -> tuple[str, np.ndarray] | None:
    """``raw``: one weight's GGUF blocks, uint8 ``[rows, bytes per row]`` → (kind the kernels take,
    uint8 ``[rows, bytes per row]`` in that kind's form), or None when the type is not executed
    as stored (its weight runs dequantized)."""
    rows = raw.shape[0]
    if kind in ("Q4_0", "Q4_1", "Q8_0"):
        return kind, raw
    if kind == "Q5_0":
        return "Q8_0", _q5_0_as_q8_0(raw.reshape(-1, 22)).reshape(rows, -1)
    if kind == "Q4_K":
        return "Q4_K", _q4_k(raw.reshape(-1, 144)).reshape(rows, -1)
    if kind == "Q6_K":
        return "Q6_K", _q6_k(raw.reshape(-1, 210)).reshape(rows, -1)
    return None


def _q5_0_as_q8_0(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    d, qh, qs = blocks[:, :2], blocks[:, 2:6], blocks[:, 6:]
    high = (qh.copy().view(np.uint32).reshape(n, 1) >> np.arange(32, dtype=np.uint32)) & np.uint32(1)
    low = np.concatenate((qs & np.uint8(15), qs >> np.uint8(4)), axis=1)
    q = (low | (high.astype(np.uint8) << np.uint8(4))).astype(np.int8) - np.int8(16)
    return np.concatenate((d, q.view(np.uint8)), axis=1)


def _q4_k(blocks: np.ndarray) -> np.ndarray:
    from gguf.quants import Q4_K

    n = blocks.shape[0]
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = Q4_K.get_scale_min(blocks[:, 4:16])
    a = (d * sc.astype(np.float32)).reshape(n, 8)  # per sub-block of 32
    b = (dmin * m.astype(np.float32)).reshape(n, 8)
    qs = blocks[:, 16:].reshape(n, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    codes = (qs & np.uint8(15)).reshape(n, 8, 32)  # [block, sub-block, input]
    packed = codes[:, :, :16] | (codes[:, :, 16:] << np.uint8(4))  # Q4_1's nibble order
    out = np.concatenate((a.reshape(n, 8, 1).view(np.uint8), b.reshape(n, 8, 1).view(np.uint8), packed), axis=2)
    return out.reshape(n, -1)


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    ql, qh = blocks[:, :128], blocks[:, 128:192]
    scales = blocks[:, 192:208].copy().view(np.int8).astype(np.float32)
    d = blocks[:, 208:210].copy().view(np.float16).astype(np.float32)
    a = (d * scales).reshape(n, 8, 2)  # per 16 inputs, two per sub-block of 32
    lo = (ql.reshape(n, -1, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & np.uint8(15)
    hi = (qh.reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & np.uint8(3)
    q = (lo.reshape(n, -1, 32) | (hi.reshape(n, -1, 32) << np.uint8(4))).astype(np.int8) - np.int8(32)
    q = q.reshape(n, 8, 32)
    out = np.concatenate((a[:, :, :1].copy().view(np.uint8), a[:, :, 1:].copy().view(np.uint8), q.view(np.uint8)), axis=2)
    return out.reshape(n, -1)


def dequantize(kind: str, blocks: np.ndarray, cols: int) -> np.ndarray:
    """float32 ``[rows, cols]`` of a weight in one of ``convert``'s output kinds (the tests'
    check that the rewrite kept gguf's values exactly)."""
    rows = blocks.shape[0]
    if kind in ("Q4_0", "Q4_1", "Q8_0"):
        from gguf.constants import GGMLQuantizationType
        from gguf.quants import dequantize as gguf_dequantize

        return gguf_dequantize(blocks, GGMLQuantizationType[kind]).reshape(rows, cols)
    per = blocks.reshape(rows, cols // 32, -1)
    first = per[:, :, 0:4].copy().view(np.float32)
    second = per[:, :, 4:8].copy().view(np.float32)
    if kind == "Q4_K":
        nib = per[:, :, 8:24]
        q = np.concatenate((nib & np.uint8(15), nib >> np.uint8(4)), axis=2).astype(np.float32)
        return (first * q - second).reshape(rows, cols)
    assert kind == "Q6_K"
    q = per[:, :, 8:40].view(np.int8).astype(np.float32)
    scale = np.concatenate((np.repeat(first, 16, axis=2), np.repeat(second, 16, axis=2)), axis=2)
    return (scale * q).reshape(rows, cols)


def group_blocks(w: GroupQuantized) -> tuple[str, torch.Tensor, torch.Tensor | None] | None:
    """``w`` as blocks tripod's kernels execute as stored — (kind, uint8 ``[N, K' / 32 * bytes]``,
    the input gather) — with exactly its values; None where no stored kind holds them (it runs
    dequantized):

    - 4-bit → ``Q4_K``'s form (``loader/stored.py``): per 32 inputs ``[a f32, b f32, 16 bytes of
      nibbles]`` with ``a = s`` and ``b = s * z`` (``w = a * q - b``), the group's scale repeated in
      each of its blocks of 32. Exact where ``s * z`` is exact in float32 (always for 16-bit scales).
    - 8-bit with the zero point 128 everywhere (symmetric; NVFP4 arrives in this form) → ``Q6_K``'s
      form: ``[a0 f32, a1 f32, 32 int8 codes q - 128]``, ``a0`` / ``a1`` the scales of inputs 0-15 /
      16-31 (groups of a multiple of 16 inputs).
    - 8-bit with other zero points (``q - z`` spans -255..255: no int8 code holds it) → two ``Q4_K``
      halves over the inputs read twice: the high nibbles ``h`` with ``a = 16 s, b = 0`` and the low
      nibbles ``l`` with ``a = s, b = s z``, so ``16 s h + (s l - s z) = s (q - z)``: each term and
      their sum exact in float32 for 16-bit scales. ``K' = 2 K`` (1.5 bytes a weight), and the gather
      is ``[perm, perm]`` (an exact copy of each input).

    Needs a group size that is a multiple of 32 (or one group per channel over K a multiple of 32).
    Act-order groups (``g_idx`` not in input order) are made contiguous by permuting the inputs once
    here: the third item is then the permutation (the linear reads ``x[:, perm]``, an exact gather;
    ``K'`` entries), else None."""
    n, k = w.shape
    gs = w.scales.shape[1]
    size = w.group_size  # (a partial last group is a multiple of 32 inputs too when K and size are)
    sym8 = w.bits == 8 and bool((w.zeros == 128).all())
    if k % 32 or (gs > 1 and size % (16 if sym8 else 32)):
        return None
    perm = None
    if not w.in_order:
        perm = torch.argsort(w.g_idx, stable=True)
        w = replace(w, codes=w.codes[:, perm].contiguous(), g_idx=w.g_idx[perm])
        if not w.in_order:  # groups of unequal sizes: no contiguous runs of `size`
            return None
    per32 = torch.arange(0, k, 32) // size  # the group of each block of 32 inputs
    if w.bits == 4:
        blocks = _q4_k_blocks(w.codes, w.scales, w.zeros, per32)
        return None if blocks is None else ("Q4_K", blocks, perm)
    if sym8:  # one scale per 16 inputs (the group's), as Q6_K holds them
        s16 = w.scales.index_select(1, torch.arange(0, k, 16) // size).view(n, k // 32, 2)
        q = (w.codes.view(n, k // 32, 32).to(torch.int16) - 128).to(torch.int8).numpy()
        a0 = s16[:, :, 0].contiguous().numpy().reshape(n, -1, 1).view(np.uint8)
        a1 = s16[:, :, 1].contiguous().numpy().reshape(n, -1, 1).view(np.uint8)
        out = np.concatenate((a0, a1, q.view(np.uint8)), axis=2)
        return "Q6_K", torch.from_numpy(np.ascontiguousarray(out.reshape(n, -1))), perm
    if w.bits == 8:  # zero points: two Q4_K halves (high nibbles x 16 s, low nibbles with s z)
        high = _q4_k_blocks(w.codes >> 4, w.scales * 16, torch.zeros_like(w.zeros), per32)
        low = _q4_k_blocks(w.codes & 15, w.scales, w.zeros, per32)
        if high is None or low is None:
            return None
        order = torch.arange(k) if perm is None else perm
        return "Q4_K", torch.cat((high, low), dim=1), torch.cat((order, order))
    return None


def _q4_k_blocks(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 per32: torch.Tensor) -> torch.Tensor | None:
    """4-bit ``codes`` uint8 ``[N, K]`` with float32 ``scales`` / integer ``zeros`` ``[N, G]`` (the
    group of each block of 32 inputs: ``per32``) → ``Q4_K`` form blocks ``[a = s, b = s z, nibbles]``;
    None where some ``s z`` rounds in float32 (float32 scales)."""
    n, k = codes.shape
    s = scales.index_select(1, per32)  # [N, K/32] float32
    z = zeros.index_select(1, per32).to(torch.float64)
    b = (s.to(torch.float64) * z).to(torch.float32)
    if not torch.equal(b.to(torch.float64), s.to(torch.float64) * z):
        return None  # float32 scales whose products with the zero points round
    q = codes.contiguous().view(n, k // 32, 32).numpy()
    nib = q[:, :, :16] | (q[:, :, 16:] << np.uint8(4))
    out = np.concatenate((s.numpy().reshape(n, -1, 1).view(np.uint8), b.numpy().reshape(n, -1, 1).view(np.uint8),
                          nib), axis=2)
    return torch.from_numpy(np.ascontiguousarray(out.reshape(n, -1)))
