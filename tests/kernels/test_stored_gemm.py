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
