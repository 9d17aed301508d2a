"""GGUF blocks in the forms tripod's kernels execute as stored (``--weights stored``).

Q4_0, Q4_1 and Q8_0 go to the kernels as the file stores them. The others are rewritten once at load,
keeping exactly the values ``gguf``'s dequantization gives:

- Q5_0 → Q8_0 blocks: the same fp16 scale ``d`` and the 5-bit code minus 16 as int8 (``d * q``).
- Q4_K → per 32 inputs ``[a f32, b f32, 16 bytes of nibbles]`` with ``a = d * sc`` and
  ``b = dmin * m`` (the float32 products gguf forms), codes laid out like Q4_1's (input j < 16: the
  low nibble of byte j; j >= 16: the high nibble of byte j - 16): ``w = a * q - b``.
- Q6_K → per 32 inputs ``[a0 f32, a1 f32, 32 int8 codes]``: ``a = d * sc`` of each 16 inputs and
  the 6-bit code minus 32: ``w = a * q``.
"""

from __future__ import annotations

import numpy as np

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
