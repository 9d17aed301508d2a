"""The stored-weights GEMM: with more rows than one register tile the quantized codes are decoded
once per tile of outputs and shared by every tile of rows; a row's bits are those of the row
alone (the direct path), on every format, with and without the residual."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch


def _blocks(fmt: str, n: int, k: int, seed: int) -> torch.Tensor:
    """Random blocks in the form pack_linear takes (GGUF's Q4_0 / Q4_1 / Q8_0; the per-32 Q4_K / Q6_K)."""
    rng = np.random.default_rng(seed)
    per = {"q4_0": 18, "q4_1": 20, "q8_0": 34, "q4_k": 24, "q6_k": 40}[fmt]
    raw = rng.integers(0, 256, size=(n, k // 32, per), dtype=np.uint8)
    if fmt in ("q4_k", "q6_k"):
        scales = rng.uniform(0.001, 0.05, size=(n, k // 32, 2)).astype(np.float32)
    else:
        scales = rng.uniform(0.001, 0.05, size=(n, k // 32, 2 if fmt == "q4_1" else 1)).astype(np.float16)
    raw[..., : scales.nbytes // (n * (k // 32))] = scales.view(np.uint8).reshape(n, k // 32, -1)
    return torch.from_numpy(raw.reshape(n, -1).copy())


@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q8_0", "q4_k", "q6_k"])
def test_every_row_of_a_batch_is_the_row_alone(ops: Any, fmt: str, act: torch.dtype) -> None:
    n, k = 70, 96  # 70 outputs: a partial last block; 3 blocks of 32 inputs
    packed = ops.pack_linear(_blocks(fmt, n, k, seed=len(fmt)), fmt, n, k)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(37, k, generator=g).to(act)
    res = torch.randn(37, n, generator=g).to(act)
    full = ops.linear_packed(x, packed, fmt, n, k, res)
    for m in (1, 3, 4, 5, 16):
        part = ops.linear_packed(x[:m], packed, fmt, n, k, res[:m])
        assert torch.equal(part, full[:m]), f"{fmt}: {m} rows differ from the same rows in a batch of 37"
    alone = torch.cat([ops.linear_packed(x[i : i + 1], packed, fmt, n, k, res[i : i + 1]) for i in range(37)])
    assert torch.equal(alone, full), f"{fmt}: a row alone differs from the row in the batch"
    xb = x.to(torch.bfloat16)
    assert torch.equal(ops.linear_packed(xb, packed, fmt, n, k)[5:6], ops.linear_packed(xb[5:6], packed, fmt, n, k))


@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("zeros", ["sym", "asym"])
def test_q4_k_form_narrowed_to_q4_0_or_q4_1_gives_the_same_bits(ops: Any, zeros: str, act: torch.dtype) -> None:
    """An int4 weight in the Q4_K form (``a = s``, ``b = s z``) whose scales fit fp16 runs as Q4_0
    (``z = 8``: symmetric) or Q4_1 (``d = s``, ``m = -s z``): fewer bytes, the same bits as the Q4_K form,
    at every row count."""
    from tripod.layers.linear import StoredWeight, narrowed

    n, k = 70, 96
    rng = np.random.default_rng(3)
    mant, exp = torch.frexp(torch.from_numpy(rng.uniform(0.001, 0.05, size=(n, k // 32)).astype(np.float32)))
    s = torch.ldexp(torch.round(mant * 64) / 64, exp)  # 6 significant bits: s * z (4 bits) is exact in fp16
    z = torch.full((n, k // 32), 8.0) if zeros == "sym" else torch.from_numpy(rng.integers(0, 16, size=(n, k // 32))).float()
    raw = torch.from_numpy(rng.integers(0, 256, size=(n, k // 32, 16), dtype=np.uint8))
    blocks = torch.cat((s.unsqueeze(2).contiguous().view(torch.uint8), (s * z).unsqueeze(2).contiguous().view(torch.uint8),
                        raw), dim=2).reshape(n, -1)
    small = narrowed(StoredWeight("Q4_K", blocks, (n, k)))
    fmt = "q4_0" if zeros == "sym" else "q4_1"
    assert small.kind == fmt.upper() and small.blocks.shape[1] == k // 32 * (18 if zeros == "sym" else 20)
    wide = ops.pack_linear(blocks, "q4_k", n, k)
    packed = ops.pack_linear(small.blocks.contiguous(), fmt, n, k)
    x = torch.randn(37, k, generator=torch.Generator().manual_seed(4)).to(act)
    for m in (1, 5, 37):
        assert torch.equal(ops.linear_packed(x[:m], packed, fmt, n, k, None), ops.linear_packed(x[:m], wide, "q4_k", n, k, None))
    # a scale fp16 does not hold keeps the Q4_K form
    big = blocks.reshape(n, -1, 24).clone()
    big[0, 0, 0:4] = torch.tensor([1e-6], dtype=torch.float32).view(torch.uint8)
    assert narrowed(StoredWeight("Q4_K", big.reshape(n, -1), (n, k))).kind == "Q4_K"
