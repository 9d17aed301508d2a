"""The kernels' ISA levels on every x86-64 host: the AVX2 build is compiled and run wherever the CPU
has AVX2 (an AVX-512 host too), every AVX level the CPU supports computes the same bits as the
others (ops and the embedded model's greedy tokens and logprobs), the level tripod picks is the best
this CPU supports, entry points refuse out-of-bounds arguments, and a build failure of a supported
level fails loudly. (The tile levels sum in their own order: tests/kernels/test_amx_tiles.py.)
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tripod import Engine, SamplingParams, kernels
from tripod.kernels.build import AVX_LEVELS, LEVELS, KernelBuild, level_reason, supported_levels

SUPPORTED = [lv for lv in supported_levels() if lv in AVX_LEVELS]  # the bit-identical levels here
pytestmark = pytest.mark.skipif(not SUPPORTED, reason=f"no kernel level runs here: {kernels.unavailable_reason()}")


def _cpuinfo_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@pytest.fixture(scope="module")
def levels() -> dict[str, Any]:
    out = {}
    for lv in SUPPORTED:
        assert kernels.load(lv, wait=True), f"the {lv} kernels must build on a CPU that supports them: {kernels.unavailable_reason(lv)}"
        out[lv] = kernels.ops(lv)
    return out


def test_the_chosen_level_is_the_best_this_cpu_supports() -> None:
    flags = _cpuinfo_flags()
    assert {"avx2", "fma", "f16c"} <= flags  # the module skips otherwise
    avx512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags
    want = "avx512_bf16" if avx512 and "avx512_bf16" in flags else "avx512" if avx512 else "avx2"
    amx = level_reason("amx_bf16") is None and KernelBuild("amx_bf16").is_built()  # granted, built and checked
    assert kernels.best_level() == ("amx_bf16" if amx else want)
    assert "avx2" in SUPPORTED and SUPPORTED[0] == want


# The comparisons need two levels; on an AVX2-only CPU test_kernels.py checks the one level
# against torch (and the tests here that need no second level still run).
needs_two = pytest.mark.skipif(len(SUPPORTED) < 2, reason="only the avx2 level runs here: nothing to compare it with")


def _same(outs: dict[str, Any], what: str) -> None:
    base_level = next(iter(outs))
    for lv, out in outs.items():
        a = out if isinstance(out, tuple) else (out,)
        b = outs[base_level] if isinstance(outs[base_level], tuple) else (outs[base_level],)
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x, y), f"{what}: {lv} differs from {base_level} (max {(x.float() - y.float()).abs().max()})"


@needs_two
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads,kvh,d", [(9, 3, 64), (8, 8, 128), (4, 1, 32), (16, 2, 96)])
def test_attention_is_bit_identical_across_levels(levels: dict[str, Any], dtype: torch.dtype, heads: int, kvh: int, d: int) -> None:
    g = torch.Generator().manual_seed(heads * d)
    slots = 1600
    kv = torch.randn(slots, 2, kvh, d, generator=g).to(dtype)
    table = torch.randperm(slots, generator=g)[:1500].view(3, 500).to(torch.int32)
    # Decode rows (one split in two pieces), an odd-length tile tail, and a prefill block.
    rows = torch.tensor([0, 1, 2] + [1] * 17, dtype=torch.int32)
    lens = torch.tensor([500, 37, 3, *range(400, 417)], dtype=torch.int32)
    q = torch.randn(len(rows), heads, d, generator=g).to(dtype)
    _same({lv: ops.paged_attention(q, kv, table, rows, lens, d**-0.5) for lv, ops in levels.items()}, f"attention {dtype}")



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads,kvh,d", [(4, 2, 32), (8, 2, 128)])
def test_a_lone_decode_row_has_the_same_bits_on_one_thread_and_in_a_block(
    levels: dict[str, Any], dtype: torch.dtype, heads: int, kvh: int, d: int
) -> None:
    """A decode row alone on one thread (every KV head in one piece, its splits' partial states
    packed) equals the row with its heads split over two threads and the same row inside a prefill
    block, on every level, bit for bit; the 1100 keys cross two 512-key splits and end mid-tile."""
    g = torch.Generator().manual_seed(d)
    kv = torch.randn(1200, 2, kvh, d, generator=g).to(dtype)
    table = torch.randperm(1200, generator=g)[:1150].view(1, 1150).to(torch.int32)
    q = torch.randn(12, heads, d, generator=g).to(dtype)
    zero = torch.zeros(1, dtype=torch.int32)
    threads = torch.get_num_threads()
    outs = {}
    try:
        for lv, ops in levels.items():
            block = ops.paged_attention(q, kv, table, torch.zeros(12, dtype=torch.int32),
                                        torch.arange(1090, 1102, dtype=torch.int32), d**-0.5)
            for n in (1, 2):
                torch.set_num_threads(n)
                alone = ops.paged_attention(q[10:11], kv, table, zero, torch.tensor([1100], dtype=torch.int32), d**-0.5)
                assert torch.equal(alone[0], block[10]), f"{lv}: the row alone on {n} thread(s) differs from it in a block"
            outs[lv] = block
    finally:
        torch.set_num_threads(threads)
    _same(outs, f"decode rows {dtype}")


def _q_blocks(kind: str, n: int, k: int, seed: int) -> torch.Tensor:
    import gguf

    if kind in ("Q4_K", "Q6_K"):  # tripod's per-32 form: [two float32 scales, codes]
        rng = np.random.default_rng(seed)
        per = 24 if kind == "Q4_K" else 40
        raw = rng.integers(0, 256, size=(n, k // 32, per), dtype=np.uint8)
        raw[..., :8] = rng.uniform(0.001, 0.05, size=(n, k // 32, 2)).astype(np.float32).view(np.uint8).reshape(n, k // 32, 8)
        return torch.from_numpy(raw.reshape(n, -1).copy())
    rng = np.random.default_rng(seed)
    qt = gguf.GGMLQuantizationType[kind]
    _, size = gguf.GGML_QUANT_SIZES[qt]
    raw = rng.integers(0, 256, size=(n, k // 32, size), dtype=np.uint8)
    # Sane fp16 scales (d, and m for Q4_1): small positive halves, no NaN/inf.
    scales = rng.uniform(0.001, 0.05, size=(n, k // 32, 2 if kind == "Q4_1" else 1)).astype(np.float16)
    raw[..., : scales.shape[-1] * 2] = scales.view(np.uint8).reshape(n, k // 32, -1)
    return torch.from_numpy(raw.reshape(n, -1).copy())


@needs_two
@pytest.mark.parametrize("fmt", ["bf16", "f32", "q4_0", "q4_1", "q8_0", "q4_k", "q6_k",
                                 "q4_0@bf16", "q4_1@bf16", "q8_0@bf16", "q4_k@bf16", "q6_k@bf16"])
@pytest.mark.parametrize("n,k", [(576, 576), (70, 96), (17, 64)])  # 70 and 17: not multiples of 16
def test_linear_is_bit_identical_across_levels(levels: dict[str, Any], fmt: str, n: int, k: int) -> None:
    """Every format, and the stored ones with bf16 activations too (``@bf16``: vdpbf16ps on the
    exact activation x code products, its order formed with FMAs elsewhere), from one row (the
    direct tiles) to more than a register tile (the decoded ones)."""
    g = torch.Generator().manual_seed(n + k)
    fmt, _, act_name = fmt.partition("@")
    if fmt not in ("bf16", "f32"):
        w = _q_blocks(fmt.upper(), n, k, seed=n)
    else:
        w = torch.randn(n, k, generator=g).to(torch.bfloat16 if fmt == "bf16" else torch.float32)
    act = torch.bfloat16 if fmt == "bf16" or act_name == "bf16" else torch.float32
    for m in (1, 3, 6, 13):
        x = torch.randn(m, k, generator=g).to(act)
        r = torch.randn(m, n, generator=g).to(act)
        outs = {lv: ops.linear_packed(x, ops.pack_linear(w, fmt, n, k), fmt, n, k, r) for lv, ops in levels.items()}
        _same(outs, f"linear {fmt} {n}x{k} rows={m}")


@needs_two
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("h", [576, 70, 9])  # scalar tails: hidden sizes not a multiple of 16
def test_norm_activation_rope_are_bit_identical_across_levels(levels: dict[str, Any], dtype: torch.dtype, h: int) -> None:
    g = torch.Generator().manual_seed(h)
    x = torch.randn(5, h, generator=g).to(dtype)
    w = torch.randn(h, generator=g).to(dtype)
    _same({lv: ops.rms_norm(x, w, 1e-5) for lv, ops in levels.items()}, f"rms_norm {h}")
    gu = torch.randn(5, 2 * h, generator=g).to(dtype)
    _same({lv: ops.silu_mul(gu) for lv, ops in levels.items()}, f"silu_mul {h}")
    heads, kvh, d = 3, 1, 64 if h != 9 else 18  # 18: a head dim whose half is not a multiple of 16
    qkv = torch.randn(4, (heads + 2 * kvh) * d, generator=g).to(dtype)
    cos, sin = torch.randn(32, d, generator=g), torch.randn(32, d, generator=g)
    pos, sl = torch.tensor([0, 5, 31, 2]), torch.tensor([1, 0, 3, 2])
    outs = {}
    for lv, ops in levels.items():
        a, pool = qkv.clone(), torch.zeros(4, 2, kvh, d, dtype=dtype)
        ops.rope_store_kv(a, pos, cos, sin, pool, sl, heads, kvh)
        outs[lv] = (a, pool)
    _same(outs, f"rope_store_kv d={d}")


def test_entry_points_refuse_out_of_bounds_arguments(levels: dict[str, Any]) -> None:
    ops = levels["avx2"]
    kv = torch.randn(10, 2, 1, 32)
    q = torch.randn(1, 2, 32)
    table = torch.arange(8, dtype=torch.int32).view(2, 4)
    one = torch.tensor([0], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="outside the pool"):
        ops.paged_attention(q, kv, torch.tensor([[0, 1, 99, 3]], dtype=torch.int32), one, torch.tensor([4], dtype=torch.int32), 0.1)
    with pytest.raises(RuntimeError, match="attends 5 keys"):
        ops.paged_attention(q, kv, table, one, torch.tensor([5], dtype=torch.int32), 0.1)
    with pytest.raises(RuntimeError, match="names table row 2"):
        ops.paged_attention(q, kv, table, torch.tensor([2], dtype=torch.int32), torch.tensor([1], dtype=torch.int32), 0.1)
    qkv = torch.randn(1, 4 * 32)
    cos = torch.randn(16, 32)
    with pytest.raises(RuntimeError, match="outside the RoPE table"):
        ops.rope_store_kv(qkv, torch.tensor([16]), cos, cos, kv, torch.tensor([0]), 2, 1)
    with pytest.raises(RuntimeError, match="outside the pool"):
        ops.rope_store_kv(qkv, torch.tensor([3]), cos, cos, kv, torch.tensor([10]), 2, 1)
    w = ops.pack_linear(torch.randn(32, 64), "f32", 32, 64)
    with pytest.raises(RuntimeError, match="packing of"):
        ops.linear_packed(torch.randn(2, 64), w, "f32", 48, 64, None)  # n larger than the packed weight
    with pytest.raises(RuntimeError, match="dtype does not match"):
        ops.linear_packed(torch.randn(2, 64), w.view(torch.int32), "f32", 32, 64, None)


@pytest.mark.slow  # (moved out of the default run: CI runs it)
@needs_two
def test_the_embedded_model_gives_the_same_tokens_and_logprobs_on_every_level(levels: dict[str, Any]) -> None:
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a quiet village,"]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=1)
    results: dict[str, list[Any]] = {}
    for weights in ("dequantized", "stored"):  # bf16 weights; the GGUF's own blocks with bf16 activations
        for lv in ("avx2", SUPPORTED[0]):
            eng = Engine(dtype="bfloat16", kernels=lv, kv_cache_tokens=2048, weights=weights)
            assert eng.runner.backend.isa == lv and eng.runner.card() == {"backend": "cpu", "isa": lv}
            outs = eng.generate(prompts, params)
            results[lv] = [(o.token_ids, [lp.logprob for lp in o.logprobs]) for o in outs]
            eng.assert_consistent()
        assert results["avx2"] == results[SUPPORTED[0]], weights


def test_a_level_this_cpu_lacks_is_refused_with_the_reason() -> None:
    missing = [lv for lv in LEVELS if lv not in supported_levels()]
    if not missing:
        pytest.skip("this CPU supports every level")
    with pytest.raises(ValueError, match=f"--kernels {missing[0]} cannot run here"):
        Engine(kernels=missing[0], kv_cache_tokens=256)


def test_a_supported_level_that_does_not_compile_fails_the_build(tmp_path: Path) -> None:
    """``make install`` runs ``python -m tripod.kernels build``: a level the CPU supports that
    does not compile must fail it (non-zero, saying which), not leave tripod on torch's ops."""
    env = {**os.environ, "TRIPOD_CACHE_DIR": str(tmp_path), "CXX": "/bin/false"}
    res = subprocess.run([sys.executable, "-m", "tripod.kernels", "build", "--level", "avx2"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode != 0
    assert "avx2" in res.stderr and "did not compile" in res.stderr
    status = subprocess.run([sys.executable, "-m", "tripod.kernels", "status"], capture_output=True, text=True,
                            env={**os.environ}, timeout=120)
    assert status.returncode == 0 and f"tripod runs the {kernels.best_level()} kernels" in status.stdout


@needs_two
def test_recurrent_kernels_are_bit_identical_across_levels(levels: dict[str, Any]) -> None:
    """The hybrid mixers' conv, gated delta rule (a decay per head or per key channel) and Mamba2
    scan (csrc/recurrent.cpp), traced rows included, at sizes with vector tails (channels, value and head sizes not multiples of 16)."""
    g = torch.Generator().manual_seed(5)
    t, slots = 11, 5
    items = torch.tensor([[0, 6, 3, 0], [6, 1, 0, -1], [7, 4, 4, 7]], dtype=torch.int64)
    x = torch.randn(t, 2 * 300, generator=g)[:, :300]
    w, b = torch.randn(300, 4, generator=g), torch.randn(300, generator=g)
    win = torch.randn(slots, 300, 3, generator=g)
    q = torch.nn.functional.normalize(torch.randn(t, 2, 20, generator=g), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(t, 2, 20, generator=g), dim=-1)
    v, decay, beta = torch.randn(t, 4, 24, generator=g), torch.rand(t, 4, generator=g), torch.rand(t, 4, generator=g)
    state = torch.randn(slots, 4, 20, 24, generator=g)
    channel_decay = torch.rand(t, 4, 20, generator=g)
    xbc = torch.randn(t, 3 * 40 + 2 * 16, generator=g)
    dt = torch.rand(t, 3, generator=g)
    ssm = torch.randn(slots, 3, 40, 16, generator=g)

    def run(ops: Any) -> tuple[torch.Tensor, ...]:
        wn, st, sm = win.clone(), state.clone(), ssm.clone()
        kw, ks, km = torch.zeros(12, 300, 3), torch.zeros(12, 4, 20, 24), torch.zeros(12, 3, 40, 16)
        co = ops.conv_update(x, wn, items, w, b, kw)
        go = ops.gated_delta(q, k, v, decay, beta, st, items, ks)
        untraced = items.clone()
        untraced[:, 3] = -1
        kda = ops.gated_delta(q, k, v, channel_decay, beta, st, untraced, None)  # KDA: a decay per key channel
        so = ops.ssd_scan(xbc[:, :120], xbc[:, 120:136], xbc[:, 136:], dt, decay[:, :3].contiguous(), sm, items, km)
        return co, wn, kw, go, kda, st, ks, so, sm, km

    _same({lv: run(ops) for lv, ops in levels.items()}, "recurrent kernels")


def test_int8_linear_is_the_exact_integer_sum_on_every_level(levels: dict[str, Any]) -> None:
    """W8A8's int8 x int8 -> int32 product (``int8_linear``: AVX512-VNNI with unsigned-offset
    activations, AVX-512BW / AVX2 vpmaddwd on sign-extended codes) is the exact sum on every level
    and path: equal to the float64 sum and to ``torch._int_mm`` at the codes' extremes (-128 · -128
    over the whole K, where a saturating int16 pair sum would be wrong), for K not a multiple of any
    vector width, outputs not a multiple of the register tile, and row counts from one to several tiles."""
    g = torch.Generator().manual_seed(48)
    paths = set()
    for m, n, k in ((1, 5, 7), (3, 33, 100), (17, 40, 576), (64, 18, 1000), (3, 9, 64)):
        q = torch.randint(-128, 128, (m, k), dtype=torch.int8, generator=g)
        w = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
        q[0], w[0], w[-1] = -128, -128, 127
        exact = q.double() @ w.double().t()
        assert exact[0, 0] == 128 * 128 * k
        try:
            int_mm = torch._int_mm(q, w.t())
        except RuntimeError:  # (a shape this torch's _int_mm refuses: the float64 sum alone)
            int_mm = None
        for lv, ops in levels.items():
            paths.add(ops.int8_path())
            outs = [ops.int8_linear(q, w), ops.int8_linear(q, w, w.sum(1, dtype=torch.int32))]
            if lv != "avx2":
                outs.append(ops.int8_linear(q, w, None, False))  # the AVX-512BW path where VNNI is present too
            for out in outs:
                assert out.dtype == torch.int32 and torch.equal(out.double(), exact), f"{lv} {m}x{n}x{k}"
                assert int_mm is None or torch.equal(out, int_mm), f"{lv} {m}x{n}x{k} vs _int_mm"
            alone = torch.cat([ops.int8_linear(q[r : r + 1], w) for r in range(m)])
            assert torch.equal(alone, outs[0]), f"{lv} {m}x{n}x{k}: rows alone != batched"
    assert "avx2" in paths
    if "avx512_vnni" in _cpuinfo_flags():
        assert paths >= {"avx512_vnni"} or "avx512" not in SUPPORTED


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_int8_linear_scaled_is_torchs_epilogue_on_every_level(levels: dict[str, Any], dtype: torch.dtype) -> None:
    """W8A8's fused product and epilogue (``int8_linear_scaled``) rounds as ``layers/w8a8.py``'s torch
    epilogue does — ``acc · (s_x · s_w)`` once in float64, then to the run dtype — on every level."""
    g = torch.Generator().manual_seed(49)
    q = torch.randint(-128, 128, (7, 300), dtype=torch.int8, generator=g)
    w = torch.randint(-128, 128, (37, 300), dtype=torch.int8, generator=g)
    sx = torch.rand(7, generator=g).to(dtype).to(torch.float64) * 1e-2
    sw = (torch.rand(37, generator=g) * torch.logspace(-4, 2, 37)).to(torch.float64)
    want = ((q.double() @ w.double().t()) * (sx.unsqueeze(1) * sw)).to(dtype)
    for lv, ops in levels.items():
        assert torch.equal(ops.int8_linear_scaled(q, w, None, sx, sw, dtype), want), lv
