"""The AMX tile code paths on every CPU with AVX512-BF16, through the test level ``amx_emu`` (the
``amx_bf16`` source over an emulation of the tile instructions, ``csrc/amx.h``):

- dense bf16 linears and GGUF blocks executed as stored (bf16 activations) give each row the same
  bits alone as in a batch of any size (few rows: vdpbf16ps in TDPBF16PS' order; more: tiles);
- they agree with a float64 product of the same weights within float32 (stored blocks) or bf16
  (dense, bf16 outputs) rounding, and with the AVX levels' results within float32 rounding;
- on a host where Linux grants AMX, the emulation gives the hardware's bits (skipped elsewhere);
- the level machinery: the CLI takes ``--level amx_bf16``/``amx_emu``, ``amx_bf16`` is the default
  only where granted and built, and otherwise the best AVX level runs and says why once.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from typing import Any

import pytest
import torch

from tripod import kernels
from tripod.kernels import selftest
from tripod.kernels.build import AVX_LEVELS, KernelBuild, level_reason

EMU_WHY = KernelBuild("amx_emu").unsupported_reason()
needs_emu = pytest.mark.skipif(EMU_WHY is not None, reason=f"the amx_emu test level cannot run here: {EMU_WHY}")
FORMATS = ("q4_0", "q4_1", "q8_0", "q4_k", "q6_k")
ROWS = (1, 2, 4, 5, 15, 16, 17, 33)  # vdpbf16ps rows (<= 4), then one, two and three row tiles


@pytest.fixture(scope="module")
def emu() -> Any:
    assert kernels.load("amx_emu", wait=True), f"the amx_emu level must build here: {kernels.unavailable_reason('amx_emu')}"
    ops = kernels.ops("amx_emu")
    assert "emulated" in ops.amx_status()
    return ops


def _dequantized(fmt: str, raw: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """float64 [n, k] weights of selftest.stored_blocks' blocks, as GGUF dequantizes them."""
    kb = k // 32
    per = raw.view(n, kb, -1)
    if fmt in ("q4_0", "q4_1", "q8_0"):
        scales = per[..., : 4 if fmt == "q4_1" else 2].contiguous().view(torch.float16).double()
        codes = per[..., 4 if fmt == "q4_1" else 2 :]
    else:
        scales = per[..., :8].contiguous().view(torch.float32).double()
        codes = per[..., 8:]
    if fmt in ("q8_0", "q6_k"):
        q = codes.contiguous().view(torch.int8).double()
    else:  # input j: the low nibble of byte j (j < 16), the high nibble of byte j - 16
        q = torch.cat([codes & 15, codes >> 4], dim=-1).double()
    a = scales[..., 0:1]
    if fmt == "q4_0":
        w = a * (q - 8)
    elif fmt == "q4_1":
        w = a * q + scales[..., 1:2]
    elif fmt == "q8_0":
        w = a * q
    elif fmt == "q4_k":
        w = a * q - scales[..., 1:2]
    else:  # q6_k: one scale per 16 inputs
        w = torch.cat([a * q[..., :16], scales[..., 1:2] * q[..., 16:]], dim=-1)
    return w.reshape(n, k)


@needs_emu
def test_the_tiles_and_the_few_row_path_add_a_pairs_even_element_first(emu: Any) -> None:
    """TDPBF16PS' documented order, seen in one sum (selftest.order_probe: 1, then 2^24 - 2^24 gives
    0 even element first, 1 odd first): the emulated tiles (19 rows) and the tile level's few-row
    vdpbf16ps path (1 row) give 0, stored and dense; the AVX levels (vdpbf16ps' order) give 1."""
    probe = selftest.order_probe(emu)
    assert probe == {"q8_0": [0.0] * 20, "bf16": [0.0] * 20}, probe
    avx = AVX_LEVELS[0] if kernels.unavailable_reason(AVX_LEVELS[0]) is None else "avx2"
    if kernels.unavailable_reason(avx) is None and kernels.load(avx):
        probe = selftest.order_probe(kernels.ops(avx))
        assert probe == {"q8_0": [1.0] * 20, "bf16": [1.0] * 20}, (avx, probe)


@needs_emu
@pytest.mark.parametrize("fmt", FORMATS)
def test_stored_blocks_on_tiles_give_each_row_its_bits_alone(emu: Any, fmt: str) -> None:
    n, k = 70, 96  # a partial last 16-output block, an odd number of them (a half column tile)
    g = torch.Generator().manual_seed(len(fmt))
    packed = emu.pack_linear(selftest.stored_blocks(fmt, n, k, g), fmt, n, k)
    x = selftest.wide(max(ROWS), k, g)
    res = torch.randn(max(ROWS), n, generator=g).to(torch.bfloat16)
    alone = torch.cat([emu.linear_packed(x[i : i + 1], packed, fmt, n, k, res[i : i + 1]) for i in range(max(ROWS))])
    for m in ROWS:
        got = emu.linear_packed(x[:m], packed, fmt, n, k, res[:m])
        assert torch.equal(got, alone[:m]), f"{fmt}: a batch of {m} rows differs from its rows alone"


@needs_emu
@pytest.mark.parametrize("fmt", FORMATS)
def test_stored_blocks_on_tiles_agree_with_float64_and_the_avx_levels(emu: Any, fmt: str) -> None:
    n, k = 48, 256
    g = torch.Generator().manual_seed(7 + len(fmt))
    raw = selftest.stored_blocks(fmt, n, k, g)
    w = _dequantized(fmt, raw, n, k)
    x = torch.randn(33, k, generator=g).to(torch.bfloat16)
    ref = x.double() @ w.T
    bound = 64 * 2.0**-24 * (x.double().abs() @ w.abs().T)  # float32 summation rounding of these terms
    got = emu.linear_packed(x.float(), emu.pack_linear(raw, fmt, n, k), fmt, n, k, None)  # float32 activations
    assert ((got.double() - ref).abs() <= bound).all(), f"{fmt}: float32 activations off the float64 product"
    # bf16 activations with float32 outputs are what a bf16 run's linears compute before rounding:
    # compare the bf16 outputs with the float64 product rounded once to bf16, within one bf16 step.
    yb = emu.linear_packed(x, emu.pack_linear(raw, fmt, n, k), fmt, n, k, None)
    assert yb.dtype == torch.bfloat16
    step = 2.0**-7 * ref.abs() + bound
    assert ((yb.double() - ref).abs() <= step).all(), f"{fmt}: tiles off the float64 product by more than bf16 rounding"
    avx = kernels.ops(AVX_LEVELS[0]) if kernels.load(AVX_LEVELS[0]) else None
    if avx is not None:
        other = avx.linear_packed(x, avx.pack_linear(raw, fmt, n, k), fmt, n, k, None)
        assert ((yb.double() - other.double()).abs() <= 2 * step).all(), f"{fmt}: tiles and {AVX_LEVELS[0]} disagree"


@needs_emu
def test_dense_bf16_on_emulated_tiles_is_batch_invariant_and_within_bf16_rounding(emu: Any) -> None:
    n, k = 70, 100  # K not a multiple of 32: a zero-padded last tile of pairs
    g = torch.Generator().manual_seed(3)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    packed = emu.pack_linear(w, "bf16", n, k)
    x = torch.randn(max(ROWS), k, generator=g).to(torch.bfloat16)
    alone = torch.cat([emu.linear_packed(x[i : i + 1], packed, "bf16", n, k, None) for i in range(max(ROWS))])
    for m in ROWS:
        assert torch.equal(emu.linear_packed(x[:m], packed, "bf16", n, k, None), alone[:m]), f"{m} rows"
    ref = x.double() @ w.double().T
    bound = 2.0**-8 * ref.abs() + 64 * 2.0**-24 * (x.double().abs() @ w.double().abs().T)
    assert ((alone.double() - ref).abs() <= bound).all()


def _amx_hardware_reason() -> str | None:
    why = level_reason("amx_bf16")
    if why is not None:
        return f"no AMX here: {why}"
    return EMU_WHY


@pytest.mark.skipif(_amx_hardware_reason() is not None, reason=f"needs AMX hardware: {_amx_hardware_reason()}")
def test_the_emulation_gives_the_hardware_bits(emu: Any) -> None:
    """On an AMX host: amx_emu (emulated tile instructions) and amx_bf16 (the hardware's) compute
    the same bits, dense and stored, at every row count."""
    assert kernels.load("amx_bf16", wait=True), kernels.unavailable_reason("amx_bf16")
    hw = kernels.ops("amx_bf16")
    assert "granted" in hw.amx_status()
    g = torch.Generator().manual_seed(11)
    n, k = 70, 160
    wd = torch.randn(n, k, generator=g).to(torch.bfloat16)
    x = selftest.wide(max(ROWS), k, g)
    assert selftest.order_probe(hw) == selftest.order_probe(emu)
    cases = [("bf16", wd)] + [(fmt, selftest.stored_blocks(fmt, n, k, g)) for fmt in FORMATS]
    for fmt, w in cases:
        for m in ROWS:
            a = emu.linear_packed(x[:m], emu.pack_linear(w, fmt, n, k), fmt, n, k, None)
            b = hw.linear_packed(x[:m], hw.pack_linear(w, fmt, n, k), fmt, n, k, None)
            assert torch.equal(a, b), f"{fmt}, {m} rows: the emulation differs from the hardware"


def test_the_cli_builds_the_tile_levels_by_name() -> None:
    """``--level amx_bf16`` is a choice of the CLI (not refused by argparse): on a CPU without AMX it
    says why it cannot build it; ``--level amx_emu`` builds the test level where AVX512-BF16 is."""
    res = subprocess.run([sys.executable, "-m", "tripod.kernels", "build", "--level", "amx_bf16"],
                         capture_output=True, text=True, timeout=900)
    assert "invalid choice" not in res.stderr
    why = level_reason("amx_bf16")
    if why is not None:
        assert res.returncode == 1 and "cannot build the amx_bf16 kernels here" in res.stderr and why in res.stderr
    else:
        assert res.returncode == 0 and "amx_bf16 CPU kernels ready" in res.stdout, res.stderr
    if EMU_WHY is None:
        res = subprocess.run([sys.executable, "-m", "tripod.kernels", "build", "--level", "amx_emu"],
                             capture_output=True, text=True, timeout=900)
        assert res.returncode == 0 and "amx_emu CPU kernels ready" in res.stdout, res.stderr


class _FakeBuild:
    def __init__(self, built: bool, failed: str | None = None) -> None:
        self.built, self.failed = built, failed

    def is_built(self) -> bool:
        return self.built

    def failed_reason(self) -> str | None:
        return self.failed

    def unsupported_reason(self) -> None:
        return None


@pytest.mark.parametrize("built,failed,want", [
    (True, None, "amx_bf16"),
    (False, None, "avx512_bf16"),
    (False, "the self-check of the amx_bf16 kernels failed", "avx512_bf16"),
])
def test_amx_is_the_default_only_where_granted_and_its_build_passed(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, built: bool, failed: str | None, want: str) -> None:
    monkeypatch.setattr(kernels, "supported_levels", lambda: ["amx_bf16", "avx512_bf16", "avx512", "avx2"])
    monkeypatch.setattr(kernels, "_build_of", lambda lv: _FakeBuild(built, failed))
    kernels._say_why_not_amx.cache_clear()
    with caplog.at_level(logging.INFO, logger="tripod.kernels"):
        assert kernels.best_level() == want
        assert kernels.best_level() == want
    said = [r.getMessage() for r in caplog.records if "not amx_bf16" in r.getMessage()]
    if want == "amx_bf16":
        assert said == []
    else:  # said once, with the reason
        assert len(said) == 1 and ("not built yet" if failed is None else "self-check") in said[0]
    kernels._say_why_not_amx.cache_clear()


def test_without_amx_the_best_avx_level_runs_and_says_why(caplog: pytest.LogCaptureFixture) -> None:
    why = level_reason("amx_bf16")
    if why is None:
        pytest.skip("this CPU runs amx_bf16")
    kernels._say_why_not_amx.cache_clear()
    with caplog.at_level(logging.INFO, logger="tripod.kernels"):
        best = kernels.best_level()
    assert best in (*AVX_LEVELS, None)
    if best is not None:
        said = [r.getMessage() for r in caplog.records if "not amx_bf16" in r.getMessage()]
        assert len(said) == 1 and why in said[0]


@pytest.mark.slow  # about a minute on 2 busy cores (the emulated tiles are slow)
@needs_emu
def test_the_embedded_model_on_emulated_tiles_gives_a_request_the_same_tokens_alone_and_batched(emu: Any) -> None:
    """The embedded model's GGUF blocks executed as stored on (emulated) tiles, bf16 activations:
    prefill chunks run on tiles, decode rows on vdpbf16ps in the tiles' order; a request's greedy
    tokens and logprobs are the same in a batch as alone (then with its prompt cached)."""
    from tripod import Engine, SamplingParams

    prompts = ["The capital of France is Paris, and the capital of Italy is", "def fibonacci(n):\n    \"\"\"Return the"]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)
    eng = Engine(dtype="bfloat16", kernels="amx_emu", kv_cache_tokens=1024, weights="stored")
    assert eng.runner.backend.isa == "amx_emu" and eng.runner.card() == {"backend": "cpu", "isa": "amx_emu"}
    batched = [(o.token_ids, [lp.logprob for lp in o.logprobs]) for o in eng.generate(prompts, params)]
    alone = [(o.token_ids, [lp.logprob for lp in o.logprobs]) for p in prompts for o in eng.generate([p], params)]
    assert batched == alone
    eng.assert_consistent()
