"""The Triton W4A16 linear in Triton's interpreter on CPU tensors, against a float64 product with the
dequantized weight (``(q - z) * s``, written here from the definition): zero points and symmetric,
group sizes 32/64/128 and per channel, act-order groups, K not a multiple of the kernel's step, M = 1
and row counts across the kernel's row block; a row alone and in a batch give the same bits."""

from __future__ import annotations

import pytest
import torch

from tripod.kernels import gpu

ops = gpu.ops()


def _weight(n: int, k: int, group: int, sym: bool, seed: int, act_order: bool = False):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    size = k if group == -1 else group
    groups = -(-k // size)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scales = (torch.rand(n, groups, generator=g) * 0.02 + 0.001).to(torch.float16).float()
    zeros = torch.full((n, groups), 8) if sym else torch.randint(0, 16, (n, groups), generator=g)
    g_idx = torch.arange(k) // size
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=g)]
    return codes, scales, zeros.to(torch.int32), g_idx


def _reference(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
               g_idx: torch.Tensor) -> torch.Tensor:
    w = (codes.double() - zeros.double()[:, g_idx]) * scales.double()[:, g_idx]
    return x.double() @ w.T


def _check(got: torch.Tensor, x: torch.Tensor, want: torch.Tensor, codes, scales, zeros, g_idx) -> None:  # type: ignore[no-untyped-def]
    # float32 sums of exact products: the error is bounded by K·eps32·Σ|x||w| (plus the output's rounding).
    w = (codes.double() - zeros.double()[:, g_idx]).abs() * scales.double()[:, g_idx]
    bound = x.double().abs() @ w.T
    eps = {torch.float32: 2**-24, torch.float16: 2**-11}[got.dtype]
    k = x.shape[1]
    err = (got.double() - want).abs()
    allowed = bound * (k * 2**-24) + want.abs() * eps + 1e-30
    assert bool(torch.all(err <= allowed)), f"max error {err.max().item():.3g}, allowed {allowed.min().item():.3g}.."


CASES = [  # (n, k, group, symmetric, act_order)
    (40, 100, 32, False, False),  # K not a multiple of the step (nor of 8), N not of the column block
    (72, 128, 64, True, False),
    (64, 256, 128, False, True),  # act-order groups: the load-time permutation
    (24, 96, -1, False, False),  # per channel
]


@pytest.mark.parametrize(("n", "k", "group", "sym", "act_order"), CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_w4a16_matches_the_float64_dequantized_product(n: int, k: int, group: int, sym: bool, act_order: bool,
                                                       dtype: torch.dtype) -> None:
    codes, scales, zeros, g_idx = _weight(n, k, group, sym, seed=n + k, act_order=act_order)
    packed = ops.pack_w4(codes, scales, zeros, g_idx)
    assert (packed.zeros is None) == sym
    assert (packed.perm is not None) == act_order
    for m in (1, 5, 17):  # one row, a part of the row block, more than one block
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
        got = ops.w4a16_linear(x, packed)
        assert got.dtype == dtype and got.shape == (m, n)
        _check(got, x, _reference(x, codes, scales, zeros, g_idx), codes, scales, zeros, g_idx)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_row_has_the_same_bits_alone_and_in_a_batch(dtype: torch.dtype) -> None:
    codes, scales, zeros, g_idx = _weight(48, 160, 32, False, seed=3)
    packed = ops.pack_w4(codes, scales, zeros, g_idx)
    x = (torch.randn(19, 160, generator=torch.Generator().manual_seed(4)) * 10).to(dtype)
    batched = ops.w4a16_linear(x, packed)
    for r in (0, 7, 16, 18):
        assert torch.equal(ops.w4a16_linear(x[r:r + 1], packed), batched[r:r + 1]), f"row {r}"
    wide = torch.zeros(19, 200, dtype=dtype)
    wide[:, :160] = x
    assert torch.equal(ops.w4a16_linear(wide[:, :160], packed), batched)  # strided rows: same bits
    assert ops.w4a16_linear(x[:0], packed).shape == (0, 48)


def test_the_packed_layout_holds_every_code() -> None:
    codes, scales, zeros, g_idx = _weight(8, 40, 32, False, seed=5)
    p = ops.pack_w4(codes, scales, zeros, g_idx)
    assert p.qweight.shape == (5, 8) and p.qweight.dtype == torch.int32
    shifts = 4 * torch.arange(8, dtype=torch.int32)
    unpacked = ((p.qweight.t()[:, :, None] >> shifts) & 0xF).reshape(8, 40)
    assert torch.equal(unpacked, codes.to(torch.int32))
    assert torch.equal(p.zeros.t().to(torch.int32), zeros) and torch.equal(p.scales.t(), scales)


def test_what_the_kernel_cannot_run_is_refused() -> None:
    codes, scales, zeros, g_idx = _weight(8, 48, 16, False, seed=6)
    with pytest.raises(ValueError, match="multiple of 32"):
        ops.pack_w4(codes, scales, zeros, g_idx)
    codes, scales, zeros, g_idx = _weight(8, 64, 32, False, seed=6)
    with pytest.raises(ValueError, match="4-bit codes"):
        ops.pack_w4(codes.to(torch.int32) * 16, scales, zeros, g_idx)
    with pytest.raises(ValueError, match="features"):
        ops.w4a16_linear(torch.zeros(2, 63), ops.pack_w4(codes, scales, zeros, g_idx))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_w4a16_at_a_larger_shape(dtype: torch.dtype) -> None:
    codes, scales, zeros, g_idx = _weight(320, 1000, 128, False, seed=9, act_order=True)
    packed = ops.pack_w4(codes, scales, zeros, g_idx)
    x = torch.randn(40, 1000, generator=torch.Generator().manual_seed(9)).to(dtype)
    _check(ops.w4a16_linear(x, packed), x, _reference(x, codes, scales, zeros, g_idx), codes, scales, zeros, g_idx)


@pytest.mark.parametrize("group", [32, 128])
def test_the_layout_from_the_stored_blocks_keeps_the_weight_and_its_group(group: int) -> None:
    from tripod.loader.hf_quant import GroupQuantized
    from tripod.loader.stored import group_blocks

    codes, scales, zeros, g_idx = _weight(16, 256, group, False, seed=7, act_order=True)
    w = GroupQuantized(codes, scales, zeros, g_idx, 4)
    kind, blocks, perm = group_blocks(w)  # type: ignore[misc]
    assert kind == "Q4_K" and perm is not None
    p = ops.from_group_blocks(blocks, 16, 256, perm)
    assert p is not None and p.group == group and p.perm is perm
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(7))
    _check(ops.w4a16_linear(x, p), x, _reference(x, codes, scales, zeros, g_idx), codes, scales, zeros, g_idx)
    freed = blocks.clone().view(16, 8, 24)
    freed[:, :, 4:8] = torch.tensor([0.3], dtype=torch.float32).view(torch.uint8)  # a GGUF Q4_K's free minimum
    assert ops.from_group_blocks(freed.view(16, -1), 16, 256, None) is None
