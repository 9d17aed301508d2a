"""Grammar masks on the device: XGrammar's packed token bitmask (one bit per token, 32 tokens per
int32 word, bit ``t % 32`` of word ``t // 32``; 1 = allowed) applied to the logits in place. The
host fills the bitmask of the constrained rows only and uploads it (a 49k vocabulary is 6 KB a
row, 1/32 of a boolean mask); one program masks one row's block of the vocabulary."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def apply_bitmask_kernel(logits_ptr, mask_ptr, rows_ptr, vocab, logits_stride, words, BLOCK: tl.constexpr):
    """``logits[rows[r], t] = -inf`` where bit ``t`` of bitmask row ``r`` is 0, for ``t < vocab``."""
    r = tl.program_id(0)
    row = tl.load(rows_ptr + r).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    keep = cols < vocab
    word = tl.load(mask_ptr + r * words + cols // 32, mask=keep, other=-1)
    allowed = (word >> (cols % 32)) & 1
    tl.store(logits_ptr + row * logits_stride + cols, tl.full((BLOCK,), float("-inf"), tl.float32)
             .to(logits_ptr.dtype.element_ty), mask=keep & (allowed == 0))


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor, vocab: int) -> None:
    """Mask ``logits`` ``[B, V]`` in place: row ``rows[r]`` by ``bitmask[r]`` (int32 ``[R, ceil(V/32)]``,
    on the logits' device), over the first ``vocab`` columns."""
    assert logits.stride(1) == 1 and bitmask.dtype == torch.int32 and bitmask.is_contiguous()
    n = rows.numel()
    if n:
        apply_bitmask_kernel[(n, triton.cdiv(vocab, BLOCK))](logits, bitmask, rows, vocab, logits.stride(0),
                                                             bitmask.shape[1], BLOCK=BLOCK)
