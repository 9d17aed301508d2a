"""Block-wise FP8 on FP8 tensor cores (``Fp8ScaledLinear``: one row-wise scaled ``torch._scaled_mm``
per column block, activations quantized per token per block as DeepSeek's inference does). The
CPU runs the same ``torch._scaled_mm`` calls (forced here: no FP8 tensor cores), so the recipe's
maths is checked against an exact evaluation of the same quantized operands, and against the
w8a16 path within e4m3's precision; where it does not apply the reason is given."""

from __future__ import annotations

import pytest
import torch

from tripod.layers.fp8 import (
    Fp8BlockLinear,
    Fp8ScaledLinear,
    Fp8Scales,
    dequantize_fp8,
    quantize_blocks,
    unsupported_reason,
)


def _weight(n: int, k: int, block: tuple[int, int], seed: int = 0) -> tuple[torch.Tensor, Fp8Scales]:
    g = torch.Generator().manual_seed(seed)
    bn, bk = block
    w = torch.randn(n, k, generator=g) * 0.05
    nb, kb = -(-n // bn), -(-k // bk)
    scale = torch.rand(nb, kb, generator=g) * 0.01 + 0.001  # a different scale per block
    full = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return (w / full).clamp(-448, 448).to(torch.float8_e4m3fn), Fp8Scales(scale, block)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize(("m", "n", "k", "block"), [(1, 256, 512, (128, 128)), (7, 192, 320, (64, 64)),
                                                    (33, 128, 256, (128, 128))])
def test_scaled_mm_blocks_equal_the_exact_quantized_product(m: int, n: int, k: int, block: tuple[int, int]) -> None:
    w, sc = _weight(n, k, block)
    bias = torch.randn(n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    assert unsupported_reason(w, sc, force=True) is None
    got = Fp8ScaledLinear(w, sc, bias)(x)
    q, sx = quantize_blocks(x, block[1])
    xq = (q.float().view(m, -1, block[1]) * sx.unsqueeze(-1)).view(m, k)
    exact = xq.double() @ dequantize_fp8(w, sc, torch.float64).T + bias.double()
    assert got.dtype == x.dtype and got.shape == (m, n)
    assert _rel(got, exact) < 1e-2  # bf16 partial sums and the bf16 output: a few 1e-3
    w8a16 = Fp8BlockLinear(w, sc, bias)(x.float())
    assert _rel(got, w8a16) < 0.06  # the activations' e4m3 rounding (3 mantissa bits)


def test_activation_blocks_quantize_within_e4m3_precision() -> None:
    x = torch.randn(5, 300) * torch.logspace(-3, 2, 300)  # blocks of very different ranges
    q, s = quantize_blocks(x, 128)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (5, 3)
    back = torch.nn.functional.pad(q.float(), (0, 84)).view(5, 3, 128) * s.unsqueeze(-1)
    err = (back.view(5, -1)[:, :300] - x).abs()
    block_max = torch.nn.functional.pad(x.abs(), (0, 84)).view(5, 3, 128).amax(-1, keepdim=True)
    bound = (block_max / 16).expand(5, 3, 128).reshape(5, -1)[:, :300]  # half of e4m3's 2^-3 step
    assert (err <= bound + 1e-9).all()


def test_where_the_fp8_gemm_does_not_apply_says_why() -> None:
    w, sc = _weight(128, 256, (128, 128))
    assert "tensor cores" in (unsupported_reason(w, sc) or "")  # the CPU: no FP8 tensor cores
    odd, osc = _weight(120, 250, (128, 128))
    assert "multiples of 16" in (unsupported_reason(odd, osc, force=True) or "")
    assert "e4m3" in (unsupported_reason(w.to(torch.float8_e5m2), sc, force=True) or "")
