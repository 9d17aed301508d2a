"""The Triton W8A8 INT8 linear in Triton's interpreter on CPU tensors: the kernel's int32 sum equals
the int64 product of the codes exactly (at the codes' extremes too), and the linear built on it
(``TritonW8A8Linear``) gives the CPU path's ``W8A8Linear`` bits — dynamic per-token and static
activation scales (a fused projection whose parts carry different scales), float32 and bfloat16,
bias and residual — a row alone and in a batch alike. What stays refused on the Triton backend
(FP8 W8A8, NVFP4 W4A4) says so; a W8A8 INT8 checkpoint decodes the CPU path's tokens (slow)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tripod.kernels import gpu

ops = gpu.ops()


def _codes(shape: tuple[int, int], seed: int) -> torch.Tensor:
    return torch.randint(-128, 128, shape, generator=torch.Generator().manual_seed(seed), dtype=torch.int8)


@pytest.mark.parametrize(("m", "n", "k"), [(1, 40, 100), (5, 64, 64), (17, 72, 130)])
def test_the_int32_sum_is_the_exact_product_of_the_codes(m: int, n: int, k: int) -> None:
    q, codes = _codes((m, k), m), _codes((n, k), n + k)
    q[0, :] = -128  # the extremes: -128 · -128 = 2^14 per product, no overflow below 2^17 inputs
    codes[0, :] = -128
    got = ops.int8_product(q, codes)
    assert got.dtype == torch.int32 and got.shape == (m, n)
    assert torch.equal(got.long(), q.long() @ codes.long().t())
    wide = torch.zeros(m, k + 9, dtype=torch.int8)
    wide[:, :k] = q
    assert torch.equal(ops.int8_product(wide[:, :k], codes), got)  # strided rows: the same sums
    assert torch.equal(ops.int8_product(q, codes[8:]), got[:, 8:])  # a row slice of the weight (static segments)


def test_what_the_int8_kernel_cannot_run_is_refused() -> None:
    with pytest.raises(ValueError, match="features"):
        ops.int8_product(_codes((2, 63), 1), _codes((8, 64), 2))
    with pytest.raises(ValueError, match="int8 codes"):
        ops.int8_product(torch.zeros(2, 64), _codes((8, 64), 2))
    with pytest.raises(ValueError, match="exact below"):
        ops.int8_product(torch.zeros(1, 2**17, dtype=torch.int8), torch.zeros(1, 2**17, dtype=torch.int8))


def _weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) / 16
    scale = (w.abs().amax(dim=1, keepdim=True) / 127).to(torch.bfloat16).float()
    return torch.round(w / scale).clamp(-128, 127).to(torch.int8), scale.reshape(-1)


def _input(m: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(m + k)
    x = (torch.randn(m, k, generator=g) * torch.logspace(-2, 1, m).unsqueeze(1)).to(dtype)
    x[min(3, m - 1)] = 0  # an all-zero row: codes 0
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("static", [False, True])
def test_the_triton_w8a8_linear_has_the_cpu_paths_bits(dtype: torch.dtype, static: bool) -> None:
    from tripod.layers.backends.triton import TritonW8A8Linear
    from tripod.layers.w8a8 import W8A8Linear

    codes, scales = _weight(96, 160, seed=4)
    bias = (torch.randn(96, generator=torch.Generator().manual_seed(5)) / 8).to(dtype)
    # static: three parts (a fused Q/K/V) with their own activation scales, the big rows clamp
    input_scales = torch.cat([torch.full((n,), v) for n, v in ((48, 0.02), (32, 0.011), (16, 0.035))]) if static else None
    cpu = W8A8Linear(codes, scales, "int8", bias, input_scales)
    tri = TritonW8A8Linear(ops, codes, scales, bias, input_scales)
    assert len(tri.segments) == (3 if static else 0)
    x = _input(19, 160, dtype)
    res = torch.randn(19, 96, generator=torch.Generator().manual_seed(6)).to(dtype)
    got = tri(x, res)
    assert got.dtype == dtype and torch.equal(got, cpu(x, res))
    for r in (0, 3, 16, 18):
        assert torch.equal(tri(x[r:r + 1]), tri(x)[r:r + 1]), f"row {r}: alone differs from batched"
    assert tri(x[:0]).shape == (0, 96)


def test_the_triton_backend_runs_int8_w8a8_and_refuses_what_it_cannot() -> None:
    from tripod.layers.backends.triton import TritonOps, TritonW8A8Linear
    from tripod.layers.linear import StoredWeight

    backend = TritonOps()
    backend.ops = ops
    codes, scales = _weight(32, 64, seed=7)
    dense = torch.zeros(32, 64)
    op = backend.linear(dense, None, stored=StoredWeight("W8A8_INT8", codes, (32, 64), scales=scales))
    assert isinstance(op, TritonW8A8Linear) and not op.static
    op = backend.linear(dense, None, stored=StoredWeight("W8A8_INT8", codes, (32, 64), scales=scales,
                                                         input_scales=torch.full((32,), 0.01)))
    assert isinstance(op, TritonW8A8Linear) and len(op.segments) == 1
    for kind in ("W8A8_FP8", "W4A4_NVFP4"):
        with pytest.raises(ValueError, match="runs W8A8 INT8 only"):
            backend.linear(dense, None, stored=StoredWeight(kind, codes, (32, 64), scales=scales))


@pytest.mark.slow
def test_a_w8a8_int8_checkpoint_decodes_the_cpu_paths_tokens(tmp_path: Path, hf_tokenizer: Any) -> None:
    """Static scales (Q/K/V and gate/up parts each with their own): the dynamic path's bits are the
    linear test's above; one checkpoint keeps the slow run short."""
    pytest.importorskip("compressed_tensors")
    from tests.support.int_quant import save_quantized
    from tests.support.tiny_models import VOCAB, build_hf
    from tripod import Engine, SamplingParams
    from tripod.layers.backends.triton import TritonW8A8Linear

    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    g = torch.Generator().manual_seed(12)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (11, 3)]
    folder, _ = save_quantized(build_hf("llama", seed=5), tmp_path / "w8a8", hf_tokenizer, "w8a8-int8-static")
    opts = dict(dtype="float32", kv_cache_tokens=256, chunk_size=16, max_batch_tokens=64, max_running=4)
    cpu = Engine(model=str(folder), **opts)
    want = [list(cpu.generate([p], params)[0].token_ids) for p in prompts]
    eng = Engine(model=str(folder), kernels="triton", weights="stored", **opts)
    qkv = eng.loaded.model.layers[0].attn.ops[eng.runner.backend.form][0]
    assert isinstance(qkv, TritonW8A8Linear) and len(qkv.segments) == 3
    assert eng.loaded.quantization_detail is not None and eng.loaded.quantization_detail["computed_by"] == (
        "the Triton int8 x int8 -> int32 kernel (W8A8, exact); cuBLAS on the other weights, dequantized at load")
    alone = [list(eng.generate([p], params)[0].token_ids) for p in prompts]
    assert alone == want  # the same bits as the CPU path, so the same greedy tokens
    assert [list(o.token_ids) for o in eng.generate(prompts, params)] == alone
