"""The Triton W8A16 linear (symmetric 8-bit codes with group scales: compressed-tensors / GPTQ W8A16,
NVFP4A16) in Triton's interpreter on CPU tensors, read from the stored form the CPU path keeps
(``loader/stored.group_blocks``' Q6_K form), against a float64 product with the dequantized weight
(``(q - 128) * s``, written here from the definition): groups 16/32/128 and per channel, act-order,
K not a multiple of the step, 1 to 17 rows; a row alone and in a batch give the same bits. An
NVFP4A16 folder's projections run on it; a compressed-tensors W8A16 folder decodes transformers'
greedy tokens (slow)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tripod.kernels import gpu

ops = gpu.ops()


def _stored(n: int, k: int, group: int, seed: int, act_order: bool = False, fp4: bool = False):  # type: ignore[no-untyped-def]
    """An 8-bit symmetric weight as the loader hands it to the backend: (codes, scales, g_idx, packed)."""
    from tripod.loader.hf_quant import GroupQuantized
    from tripod.loader.stored import group_blocks

    g = torch.Generator().manual_seed(seed)
    size = k if group == -1 else group
    groups = -(-k // size)
    if fp4:  # NVFP4's values as the loader holds them: 2 · e2m1 in -12..12, offset by 128
        codes = (torch.tensor([0, 1, 2, 3, 4, 6, 8, 12])[torch.randint(0, 8, (n, k), generator=g)]
                 * torch.where(torch.rand(n, k, generator=g) < 0.5, -1, 1) + 128).to(torch.uint8)
    else:
        codes = torch.randint(0, 256, (n, k), generator=g, dtype=torch.uint8)
    scales = (torch.rand(n, groups, generator=g) * 0.002 + 1e-4).to(torch.bfloat16).float()
    g_idx = torch.arange(k) // size
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=g)]
    stored = group_blocks(GroupQuantized(codes, scales, torch.full((n, groups), 128, dtype=torch.int32), g_idx, 8))
    assert stored is not None and stored[0] == "Q6_K"
    packed = ops.from_q8_blocks(stored[1], n, k, stored[2])
    assert packed is not None
    return codes, scales, g_idx, packed


def _check(got: torch.Tensor, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor) -> None:
    # float32 sums of the code-activation products: the error is bounded by K·eps32·Σ|x||w| (plus the output's rounding).
    w = (codes.double() - 128) * scales.double()[:, g_idx]
    want = x.double() @ w.T
    bound = x.double().abs() @ w.abs().T
    eps = {torch.float32: 2**-24, torch.float16: 2**-11, torch.bfloat16: 2**-8}[got.dtype]
    err = (got.double() - want).abs()
    allowed = bound * (x.shape[1] * 2**-24) + want.abs() * eps + 1e-30
    assert bool(torch.all(err <= allowed)), f"max error {err.max().item():.3g}"


def _asymmetric(n: int, k: int, group: int, seed: int, act_order: bool = False):  # type: ignore[no-untyped-def]
    """An 8-bit weight with zero points as the loader hands it over (two 4-bit halves, K' = 2K)."""
    from tripod.loader.hf_quant import GroupQuantized
    from tripod.loader.stored import group_blocks

    g = torch.Generator().manual_seed(seed)
    size = k if group == -1 else group
    groups = -(-k // size)
    codes = torch.randint(0, 256, (n, k), generator=g, dtype=torch.uint8)
    scales = (torch.rand(n, groups, generator=g) * 0.002 + 1e-4).to(torch.bfloat16).float()
    zeros = torch.randint(0, 256, (n, groups), generator=g, dtype=torch.int32)
    g_idx = torch.arange(k) // size
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=g)]
    stored = group_blocks(GroupQuantized(codes, scales, zeros, g_idx, 8))
    assert stored is not None and stored[0] == "Q4_K" and stored[1].shape[1] == 2 * k // 32 * 24
    assert ops.from_q8_blocks(stored[1], n, k, stored[2]) is None  # not the symmetric form
    packed = ops.from_q8_halves(stored[1], n, k, stored[2])
    assert packed is not None and packed.zeros is not None
    return codes, scales, zeros, g_idx, packed


@pytest.mark.parametrize(("group", "act_order", "dtype"), [(32, False, torch.float16), (128, True, torch.float32),
                                                        (-1, False, torch.float32)])
def test_w8a16_with_zero_points_matches_the_float64_dequantized_product(group: int, act_order: bool,
                                                                         dtype: torch.dtype) -> None:
    codes, scales, zeros, g_idx, packed = _asymmetric(40, 256 if group == 128 else 96, group, seed=group,
                                                      act_order=act_order)
    assert (packed.perm is not None) == act_order
    x = torch.randn(17, codes.shape[1], generator=torch.Generator().manual_seed(2)).to(dtype)
    got = ops.w8a16_linear(x, packed)
    for r in (0, 16):
        assert torch.equal(ops.w8a16_linear(x[r:r + 1], packed), got[r:r + 1]), f"row {r}"
    # (the symmetric check's reference with codes shifted by each group's zero point: (q - z) * s)
    _check(got, x, codes.to(torch.int32) - zeros[:, g_idx] + 128, scales, g_idx)
    from tripod.loader.hf_quant import GroupQuantized
    from tripod.loader.stored import (
        group_blocks,  # a 4-bit weight's blocks are not the halves' form
    )

    four = group_blocks(GroupQuantized(codes % 16, scales, zeros % 16, g_idx, 4))
    assert four is not None and ops.from_q8_halves(four[1], 40, codes.shape[1] // 2, four[2]) is None


CASES = [  # (n, k, group, act_order, fp4)
    (40, 96, 32, False, False),  # K not a multiple of the 64-input step, N not of the column block
    (72, 256, 128, True, False),  # act-order groups: the load-time permutation
    (24, 160, -1, False, False),  # per channel
    (48, 64, 16, False, True),  # NVFP4A16: groups of 16
]


@pytest.mark.parametrize(("n", "k", "group", "act_order", "fp4"), CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # (bf16: the interpreter's dot has none)
def test_w8a16_matches_the_float64_dequantized_product(n: int, k: int, group: int, act_order: bool, fp4: bool,
                                                       dtype: torch.dtype) -> None:
    codes, scales, g_idx, packed = _stored(n, k, group, seed=n + k, act_order=act_order, fp4=fp4)
    assert packed.group == (-(-k // 64) * 64 if group == -1 else group)
    assert (packed.perm is not None) == act_order
    for m in (1, 17):  # one row, more than one row block
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
        got = ops.w8a16_linear(x, packed)
        assert got.dtype == dtype and got.shape == (m, n)
        _check(got, x, codes, scales, g_idx)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_row_has_the_same_bits_alone_and_in_a_batch(dtype: torch.dtype) -> None:
    _, _, _, packed = _stored(48, 160, 32, seed=3)
    x = (torch.randn(19, 160, generator=torch.Generator().manual_seed(4)) * 10).to(dtype)
    batched = ops.w8a16_linear(x, packed)
    for r in (0, 7, 16, 18):
        assert torch.equal(ops.w8a16_linear(x[r:r + 1], packed), batched[r:r + 1]), f"row {r}"
    wide = torch.zeros(19, 200, dtype=dtype)
    wide[:, :160] = x
    assert torch.equal(ops.w8a16_linear(wide[:, :160], packed), batched)  # strided rows: same bits
    assert ops.w8a16_linear(x[:0], packed).shape == (0, 48)
    with pytest.raises(ValueError, match="features"):
        ops.w8a16_linear(x[:, :150], packed)
    assert ops.from_q8_blocks(torch.zeros(48, 160 // 32 * 24, dtype=torch.uint8), 48, 160, None) is None  # not that form


@pytest.mark.slow
def test_a_w8a16_checkpoint_runs_on_the_w8a16_kernel(tmp_path: Path, hf_tokenizer: Any) -> None:
    """compressed-tensors W8A16 per channel: transformers' greedy tokens (dequantized weights, float32),
    batched = alone."""
    from tests.conftest import HFReference, check_greedy_tokens
    from tests.support.int_quant import save_quantized
    from tests.support.tiny_models import VOCAB, build_hf
    from tripod import Engine, SamplingParams
    from tripod.layers.backends.triton import W8A16Linear

    model = build_hf("llama", seed=5)
    folder, deq = save_quantized(model, tmp_path / "w8a16", hf_tokenizer, "ct", bits=8, group=-1, sym=True)
    model.load_state_dict(deq, strict=False)
    ref = HFReference(model.eval())
    eng = Engine(model=str(folder), kernels="triton", dtype="float32", weights="stored", kv_cache_tokens=256,
                 chunk_size=16, max_batch_tokens=64, max_running=4)
    gate_up, down = eng.loaded.model.layers[0].mlp.ops[eng.runner.backend.form]
    assert isinstance(gate_up, W8A16Linear) and isinstance(down, W8A16Linear)
    assert gate_up.packed.group == 64  # per channel over K = 64 inputs
    assert eng.loaded.quantization_detail is not None and eng.loaded.quantization_detail["computed_by"].startswith(
        "the Triton W8A16 kernel")
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    g = torch.Generator().manual_seed(12)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (11, 3)]
    alone = [eng.generate([p], params)[0].token_ids for p in prompts]
    for i, got in enumerate(alone):
        check_greedy_tokens(got, ref.greedy(prompts[i], 4), f"w8a16 prompt {i}")
    for i, out in enumerate(eng.generate(prompts, params)):
        assert list(out.token_ids) == list(alone[i]), f"w8a16 prompt {i}: batched differs from alone"


FOLDERS = {  # name -> (method, options, the kernel's group)
    "nvfp4a16": ("nvfp4", {}, 16),
    "ct-w8a16-g32": ("ct", dict(bits=8, group=32, sym=True), 32),
    "gptq-8bit-asym-g32": ("gptq", dict(bits=8, group=32, sym=False), 32),
}


@pytest.mark.parametrize("case", list(FOLDERS))
def test_a_folders_8_bit_and_fp4_linears_run_on_the_w8a16_kernel(case: str, tmp_path: Path, hf_tokenizer: Any) -> None:
    """An NVFP4A16 folder's projections (FP4 codes, FP8 scales per 16 inputs over a global scale), a
    compressed-tensors W8A16 folder's and a GPTQ 8-bit one's with zero points run on the W8A16 kernel,
    each the product with the weights dequantized from the checkpoint's own tensors
    (``save_quantized``'s) within float32's summation bound."""
    from tests.support.int_quant import save_quantized
    from tests.support.tiny_models import build_hf
    from tripod import Engine
    from tripod.layers.backends.triton import W8A16Linear

    method, opts, group = FOLDERS[case]
    folder, deq = save_quantized(build_hf("llama", seed=5), tmp_path / case, hf_tokenizer, method, **opts)
    eng = Engine(model=str(folder), kernels="triton", dtype="float32", weights="stored", kv_cache_tokens=64,
                 chunk_size=16, max_batch_tokens=16, max_running=1)
    layer = eng.loaded.model.layers[1]
    gate_up, down = layer.mlp.ops[eng.runner.backend.form]
    assert isinstance(gate_up, W8A16Linear) and isinstance(down, W8A16Linear) and gate_up.packed.group == group
    assert (gate_up.packed.zeros is not None) == (method == "gptq")
    x = torch.randn(5, gate_up.packed.k, generator=torch.Generator().manual_seed(1))
    w = torch.cat([deq[f"model.layers.1.mlp.{p}_proj.weight"] for p in ("gate", "up")]).double()
    err = (gate_up(x).double() - x.double() @ w.T).abs()
    assert bool(torch.all(err <= (x.double().abs() @ w.abs().T) * (x.shape[1] * 2**-24) + 1e-30)), err.max()
