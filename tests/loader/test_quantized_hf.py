"""AWQ, GPTQ and compressed-tensors (pack-quantized) folders: loaded, token-exact, refused clearly.

Tiny random Llama / Qwen3 checkpoints are quantized by the test-side packers (``tests/support/
int_quant.py``, written from each format's documentation) and the fp32 reference is transformers
holding the test's own dequantization of the same codes. tripod must decode the reference's greedy
tokens with the weights dequantized at load (float32, the reference path: the same weights, the
same math) and with the integer weights executed as stored on tripod's CPU kernels (float32
activations: exact code x activation products, the scales applied per block of 32 — the same
values summed in another order, so near ties may differ, as for the GGUF stored path), each prompt
alone and all in one batch, the batch hitting the prefix cache.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import HFReference, check_greedy_tokens
from tests.support.int_quant import save_quantized
from tests.support.tiny_models import VOCAB, build_hf
from tripod import Engine, SamplingParams, kernels
from tripod.kernels.build import supported_levels

N_TOKENS = 16


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    a = torch.randint(3, VOCAB, (37,), generator=g).tolist()
    b = torch.randint(3, VOCAB, (6,), generator=g).tolist()
    c = a[:29] + torch.randint(3, VOCAB, (4,), generator=g).tolist()  # shares a's first 29 tokens
    return [a, b, c]


PROMPTS = _prompts()
PARAMS = SamplingParams(max_tokens=N_TOKENS, temperature=0.0, ignore_eos=True)
NO_KERNELS = kernels.unavailable_reason()

# name -> (family, method, options, config overrides)
CASES: dict[str, tuple[str, str, dict[str, Any], dict[str, Any]]] = {
    "awq-g32": ("llama", "awq", dict(bits=4, group=32), {}),
    "awq-g128-ignore": ("qwen3", "awq", dict(bits=4, group=128, ignore=("down_proj",)),
                        dict(hidden_size=128, intermediate_size=256, head_dim=32)),
    "gptq-4bit-sym-g64": ("llama", "gptq", dict(bits=4, group=64, sym=True),
                          dict(hidden_size=128, intermediate_size=192)),
    "gptq-4bit-asym-desc-act": ("qwen3", "gptq", dict(bits=4, group=32, sym=False, act_order=True), {}),
    "gptq-8bit-sym-channel": ("llama", "gptq", dict(bits=8, group=-1, sym=True), {}),
    "gptq-8bit-asym-g32": ("qwen3", "gptq", dict(bits=8, group=32, sym=False), {}),
    "ct-w4a16-sym-g32-ignore": ("qwen3", "ct", dict(bits=4, group=32, sym=True, ignore=("o_proj",)), {}),
    "ct-w4a16-asym-g32": ("llama", "ct", dict(bits=4, group=32, sym=False), {}),
    "ct-w8a16-channel": ("llama", "ct", dict(bits=8, group=-1, sym=True), {}),
    "ct-w4a16-actorder": ("llama", "ct", dict(bits=4, group=32, sym=True, act_order=True), {}),
    "gptq-moe-experts": ("qwen3-moe", "gptq", dict(bits=4, group=32, sym=True), {}),  # quantized experts
    "ct-mixtral-experts": ("mixtral", "ct", dict(bits=4, group=32, sym=False), {}),
    "awq-qwen2-moe-experts": ("qwen2-moe", "awq", dict(bits=4, group=32), dict(shared_expert_intermediate_size=64)),
    "ct-nvfp4a16": ("qwen3", "nvfp4", dict(ignore=("down_proj",)), {}),
}
# The cases whose every quantized weight runs as stored (4-bit, act-order permuted at load; 8-bit
# symmetric, or with zero points as two 4-bit halves).
STORED = ("awq-g32", "awq-g128-ignore", "gptq-4bit-sym-g64", "gptq-4bit-asym-desc-act", "gptq-8bit-sym-channel",
          "gptq-8bit-asym-g32", "ct-w4a16-sym-g32-ignore", "ct-w4a16-asym-g32", "ct-w8a16-channel",
          "ct-w4a16-actorder", "ct-nvfp4a16")


@pytest.fixture(scope="module")
def quantized(tmp_path_factory: pytest.TempPathFactory, hf_tokenizer: Any) -> Any:
    made: dict[str, tuple[Path, HFReference]] = {}

    def get(case: str) -> tuple[Path, HFReference]:
        if case not in made:
            family, method, opts, over = CASES[case]
            model = build_hf(family, seed=5, **over)
            folder, deq = save_quantized(model, tmp_path_factory.mktemp(case), hf_tokenizer, method, **opts)
            missing, unexpected = model.load_state_dict(deq, strict=False)
            assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
            made[case] = (folder, HFReference(model.eval()))
        return made[case]

    return get


def _check(eng: Engine, ref: HFReference, what: str) -> None:
    refs = [ref.greedy(p, N_TOKENS) for p in PROMPTS]
    alone = [eng.generate([p], PARAMS)[0].token_ids for p in PROMPTS]
    for i, got in enumerate(alone):
        check_greedy_tokens(got, refs[i], f"{what} prompt {i} alone")
    cached = eng.stats.cached_prompt_tokens
    batched = eng.generate(PROMPTS, PARAMS)
    for i, out in enumerate(batched):
        assert list(out.token_ids) == list(alone[i]), f"{what} prompt {i}: batched differs from alone"
    assert eng.stats.cached_prompt_tokens > cached, "the batched run never hit the prefix cache"
    eng.assert_consistent()


# One case of each test runs by default (~60 s for the file on 2 cores); the rest are slow.
DEFAULT_DEQUANTIZED = "gptq-4bit-asym-desc-act"
DEFAULT_STORED = "ct-w4a16-actorder"


def _cases(names: tuple[str, ...] | list[str], default: str) -> list[Any]:
    return [pytest.param(c, marks=() if c == default else pytest.mark.slow) for c in names]


@pytest.mark.parametrize("case", _cases(list(CASES), DEFAULT_DEQUANTIZED))
def test_dequantized_weights_decode_the_reference_tokens(case: str, quantized: Any) -> None:
    folder, ref = quantized(case)
    eng = Engine(model=str(folder), dtype="float32", kv_cache_tokens=2048, chunk_size=16, max_batch_tokens=64, max_running=8,
                 weights="dequantized", kernels="eager")
    method = CASES[case][1]
    assert eng.loaded.quantization.startswith({"ct": "compressed-tensors pack-quantized",
                                               "nvfp4": "compressed-tensors nvfp4-pack-quantized"}.get(method, method))
    assert eng.loaded.weights == "dequantized"
    detail = eng.loaded.quantization_detail  # /v1/models' quantization_detail
    assert detail is not None and eng.loaded.quantization.startswith(detail["format"])
    assert detail["computed_by"] == "dense linears on the weights dequantized at load"
    _check(eng, ref, f"{case} dequantized")


@pytest.mark.skipif(NO_KERNELS is not None, reason=f"kernels unavailable: {NO_KERNELS}")
@pytest.mark.parametrize("case", _cases(STORED, DEFAULT_STORED))
def test_stored_codes_decode_the_reference_tokens(case: str, quantized: Any) -> None:
    from tripod.layers.linear import KernelLinear

    folder, ref = quantized(case)
    eng = Engine(model=str(folder), dtype="float32", kv_cache_tokens=2048, chunk_size=16, max_batch_tokens=64, max_running=8,
                 weights="stored")
    net = eng.loaded.model
    assert eng.loaded.weights == "stored" and net.has_stored_weights
    layer = net.layers[0]
    ignored = CASES[case][2].get("ignore", ())
    want = {"qkv", "gate_up"} | ({"down"} if "down_proj" not in ignored else set()) | ({"o"} if "o_proj" not in ignored else set())
    assert set(layer.stored) == want, set(layer.stored)
    gate_up, _down = layer.mlp.ops[eng.runner.backend.form]
    opts = CASES[case][2]
    q4 = (opts.get("bits") == 4 or not opts.get("sym", True)) and CASES[case][1] != "nvfp4"  # int4; int8 with zero points
    # int4 runs as the Q4_K form, or as Q4_0 / Q4_1 where those hold its values (fp16-exact scales;
    # symmetric: Q4_0), layers/linear.narrowed
    want_fmt = ("q4_0" if opts.get("sym") else ("q4_1", "q4_k")) if q4 else "q6_k"
    assert isinstance(gate_up, KernelLinear) and gate_up.fmt in want_fmt, gate_up.fmt
    if opts.get("bits") == 8 and not opts.get("sym", True):  # two halves over the inputs read twice
        assert gate_up.k == 2 * net.cfg.hidden_size
    detail = eng.loaded.quantization_detail  # /v1/models' quantization_detail
    assert detail is not None and f"stored {gate_up.fmt.upper()} blocks" in detail["computed_by"]
    if CASES[case][1] != "nvfp4":
        assert (detail["bits"], detail["group_size"]) == (opts.get("bits", 4), opts.get("group", 32))
    _check(eng, ref, f"{case} stored")


@pytest.mark.skipif(NO_KERNELS is not None, reason=f"kernels unavailable: {NO_KERNELS}")
def test_auto_picks_stored_for_groups_of_32_and_dequantized_for_others(quantized: Any, tmp_path: Path) -> None:
    from tests.support.int_quant import quant_config
    from tripod.config import EngineConfig
    from tripod.loader.weights_mode import auto_weights

    folder, _ = quantized("awq-g32")
    mode, why = auto_weights(EngineConfig(model=str(folder)))
    assert mode == "stored" and "awq (int4, group 32, zero points)" in why, why
    folder, _ = quantized("gptq-8bit-asym-g32")
    mode, why = auto_weights(EngineConfig(model=str(folder)))
    assert mode == "stored" and "gptq (int8, group 32, zero points)" in why, why
    odd = _folder_with(quantized, tmp_path, "gptq-8bit-asym-g32", config=quant_config("gptq", 8, 48, False, False, ()))
    mode, why = auto_weights(EngineConfig(model=str(odd)))
    assert mode == "dequantized" and "multiple of 32" in why, why
    mode, why = auto_weights(EngineConfig(model=str(folder), dtype="float32"))
    assert mode == "dequantized" and "--dtype float32" in why


def test_stored_blocks_hold_exactly_the_dequantized_values(quantized: Any) -> None:
    """The Q4_K / Q6_K rewrite of the stored cases' weights keeps each value (a*q - b = (q - z)*s),
    act-order ones with their inputs permuted once at load."""
    import numpy as np

    from tripod.loader.hf_loader import HFFolder
    from tripod.loader.stored import dequantize

    for case in ("awq-g32", "gptq-8bit-sym-channel", "ct-w4a16-asym-g32", "gptq-4bit-asym-desc-act", "ct-nvfp4a16",
                 "gptq-8bit-asym-g32"):
        folder, _ = quantized(case)
        src = HFFolder(folder)
        deq = src.weights()
        stored = src.stored_weights()
        assert stored
        for name, sw in stored.items():
            got = dequantize(sw.kind, sw.blocks.numpy(), sw.shape[1])
            k = deq[name].shape[1]
            if case == "gptq-8bit-asym-g32":  # two halves, 16 s h and s l - s z: their float32 sum is exact
                assert sw.shape[1] == 2 * k and torch.equal(sw.perm, torch.cat((torch.arange(k), torch.arange(k))))
                got = got[:, :k] + got[:, k:]
            want = deq[name] if sw.perm is None or sw.shape[1] == 2 * k else deq[name][:, sw.perm]  # act-order
            assert (sw.perm is not None) == (case.endswith("desc-act") or case == "gptq-8bit-asym-g32")
            assert np.array_equal(got, want.numpy()), f"{case}: {name} ({sw.kind}) differs"


# ---------------------------------------------------------------------------- refusals
def _folder_with(quantized: Any, tmp_path: Path, case: str, *, config: dict[str, Any] | None = None,
                 drop: str | None = None, reshape: str | None = None) -> Path:
    """A copy of ``case``'s folder with its quantization_config replaced, or one tensor dropped or cut."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder, _ = quantized(case)
    dst = tmp_path / "bad"
    shutil.copytree(folder, dst)
    if config is not None:
        cfg = json.loads((dst / "config.json").read_text())
        cfg["quantization_config"] = config
        (dst / "config.json").write_text(json.dumps(cfg))
    if drop or reshape:
        f = dst / "model.safetensors"
        t = load_file(str(f))
        if drop:
            del t[drop]
        if reshape:
            t[reshape] = t[reshape][:-1].contiguous()
        save_file(t, str(f), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("config, match", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "not supported.*AWQ.*GPTQ.*compressed-tensors"),
    ({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemv"}, "AWQ version 'gemv' is not supported"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 32}, "GPTQ with 3-bit weights is not supported"),
    ({"quant_method": "compressed-tensors", "format": "int-quantized",
      "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "strategy": "channel"},
                              "input_activations": {"num_bits": 8, "type": "int", "dynamic": True}}}},
     "input activations .* are not supported; tripod runs W8A8 with symmetric 8-bit int activations quantized "
     "dynamically per token"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "tensor"}}}},
     "strategy 'tensor' is not supported"),
    ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
      "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "float", "group_size": 16},
                              "input_activations": {"num_bits": 4, "type": "float", "group_size": 16}}}},
     r"NVFP4 input activations .* are not supported; tripod runs NVFP4 W4A4 as llmcompressor's NVFP4 scheme"),
])
def test_unsupported_schemes_are_refused_at_start(config: dict[str, Any], match: str, quantized: Any,
                                                  tmp_path: Path) -> None:
    folder = _folder_with(quantized, tmp_path, "awq-g32", config=config)
    with pytest.raises(ValueError, match=match):
        Engine(model=str(folder), dtype="float32", kv_cache_tokens=256)


@pytest.mark.parametrize("case, drop, reshape, match", [
    ("awq-g32", "model.layers.0.self_attn.q_proj.scales", None, "missing model.layers.0.self_attn.q_proj.scales"),
    ("gptq-4bit-sym-g64", None, "model.layers.1.mlp.up_proj.scales", r"up_proj.scales has shape \(1, 192\), expected \(2, 192\)"),
    ("ct-w4a16-asym-g32", "model.layers.0.mlp.down_proj.weight_zero_point", None, "missing .*down_proj.weight_zero_point"),
    ("ct-w4a16-asym-g32", "model.layers.2.self_attn.k_proj.weight_packed", None, r"k_proj.weight_\w+ has no weight_packed"),
])
def test_malformed_checkpoints_are_refused(case: str, drop: str | None, reshape: str | None, match: str,
                                           quantized: Any, tmp_path: Path) -> None:
    folder = _folder_with(quantized, tmp_path, case, drop=drop, reshape=reshape)
    with pytest.raises(ValueError, match=match):
        Engine(model=str(folder), dtype="float32", kv_cache_tokens=256, weights="dequantized")


def test_a_scheme_that_does_not_match_the_tensors_is_refused(quantized: Any, tmp_path: Path) -> None:
    """The config says group 64 but the tensors hold groups of 32: the shapes say so."""
    from tests.support.int_quant import quant_config

    folder = _folder_with(quantized, tmp_path, "awq-g32", config=quant_config("awq", 4, 64, False, False, ()))
    with pytest.raises(ValueError, match=r"scales has shape \(2, \d+\), expected \(1, \d+\)|not a multiple of group_size 64"):
        Engine(model=str(folder), dtype="float32", kv_cache_tokens=256, weights="dequantized")


# ---------------------------------------------------------------------------- compressed-tensors' own code
@pytest.mark.parametrize("bits, sym", [(4, True), (4, False), (8, True)])
def test_compressed_tensors_packs_as_the_test_packer(bits: int, sym: bool) -> None:
    """The package's own ``pack_to_int32`` (signed codes, zero points along the outputs) makes the
    test packer's tensors bit for bit, and tripod unpacks them to the same codes."""
    ct = pytest.importorskip("compressed_tensors.compressors")
    from tests.support.int_quant import pack_ct, quantize
    from tripod.loader.hf_quant import CompressedTensorsFormat

    w = torch.randn(40, 96, generator=torch.Generator().manual_seed(bits))
    q = quantize(w, bits, 32, sym, torch.bfloat16)
    mine = pack_ct(q, bits, sym, act_order=False)
    offset = 1 << (bits - 1)
    signed = (q.codes - offset).to(torch.int8)
    assert torch.equal(ct.pack_to_int32(signed, bits), mine["weight_packed"])
    if not sym:
        assert torch.equal(ct.pack_to_int32((q.zeros - offset).to(torch.int8), bits, packed_dim=0),
                           mine["weight_zero_point"])
    from tests.support.int_quant import quant_config

    fmt = CompressedTensorsFormat(quant_config("ct", bits, 32, sym, False, ()))
    got = fmt.unpack({f"m.{k}": v for k, v in mine.items()}, "m")
    assert torch.equal(got.codes.long(), q.codes) and torch.equal(got.dequantize(), q.dequantize())


@pytest.mark.parametrize("case", ["ct-w4a16-asym-g32", "ct-nvfp4a16"])
def test_transformers_decompression_agrees_up_to_its_bf16_rounding(case: str, quantized: Any) -> None:
    """transformers' own loading of a compressed-tensors folder (the package decompresses it)
    gives tripod's dequantized weights rounded to the scales' dtype (bf16): it forms ``(q - z) * s``
    in bf16, tripod in float32, exactly."""
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    from tripod.loader.hf_loader import HFFolder

    folder, _ = quantized(case)
    ours = HFFolder(folder).weights()
    theirs = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32,
                                                  quantization_config=CompressedTensorsConfig(dequantize=True)).state_dict()
    quantized_names = [n for n in ours if n.endswith("proj.weight") and n.startswith("model.layers.")
                       and not (case == "ct-nvfp4a16" and "down_proj" in n)]
    assert quantized_names
    for name in quantized_names:
        assert torch.equal(theirs[name], ours[name].bfloat16().float()), name
        assert not torch.equal(theirs[name], ours[name])  # (so the bf16 rounding is real, and said)



@pytest.mark.skipif(NO_KERNELS is not None, reason=f"kernels unavailable: {NO_KERNELS}")
@pytest.mark.parametrize("act_order", [False, True])
def test_a_partial_last_group_runs_stored_with_its_values(act_order: bool) -> None:
    """K not a multiple of the group (SmolLM2's 576 inputs in groups of 128: four of 128 and one of
    64): the group size is the configured one, not ceil(K / groups), so the weight runs stored (it
    ran dequantized before) and its blocks hold exactly the checkpoint's values."""
    from tests.support.int_quant import quantize
    from tripod.loader.hf_quant import GroupQuantized
    from tripod.loader.stored import dequantize, group_blocks

    g = torch.Generator().manual_seed(7)
    n, k = 16, 160  # groups of 64: 64 + 64 + 32
    g_idx = torch.arange(k) // 64
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=g)]
    q = quantize(torch.randn(n, k, generator=g), 4, 64, True, torch.bfloat16, g_idx)
    w = GroupQuantized(q.codes.to(torch.uint8), q.scales.float(), q.zeros.to(torch.int32), q.g_idx, 4)
    assert w.group_size == 64 and w.in_order != act_order
    kind, blocks, perm = group_blocks(w) or (None, None, None)
    assert kind == "Q4_K" and (perm is not None) == act_order
    want = q.dequantize() if perm is None else q.dequantize()[:, perm]
    assert torch.equal(torch.from_numpy(dequantize(kind, blocks.numpy(), k)), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits, act_order, sym", [(4, True, False), (4, False, False), (8, False, True),
                                                  (8, True, False)])
def test_a_stored_linear_gives_each_row_the_same_bits_at_every_row_count(dtype: torch.dtype, bits: int,
                                                                          act_order: bool, sym: bool) -> None:
    """One stored projection (act-order: inputs permuted at load) on the kernels: a row's output is
    bit-identical alone and among 1..9 rows (the sums never depend on the batch), and equals the
    dequantized weight's product up to float32 summation order."""
    from tests.support.int_quant import quantize
    from tripod.layers.linear import KernelLinear, StoredWeight
    from tripod.loader.hf_quant import GroupQuantized
    from tripod.loader.stored import group_blocks

    g = torch.Generator().manual_seed(bits)
    n, k = 48, 128
    g_idx = torch.randperm(k, generator=g) // 32 if act_order else None
    q = quantize(torch.randn(n, k, generator=g), bits, 32, sym, torch.float16, g_idx)
    w = GroupQuantized(q.codes.to(torch.uint8), q.scales.float(), q.zeros.to(torch.int32), q.g_idx, bits)
    kind, blocks, perm = group_blocks(w) or (None, None, None)
    assert kind == ("Q6_K" if sym and bits == 8 else "Q4_K") and (perm is not None) == (act_order or (not sym and bits == 8))
    kk = k if perm is None else int(perm.numel())  # 8-bit with zero points: two halves, K' = 2K
    x = torch.randn(9, k, generator=g).to(dtype)
    first = packed = None
    for level in supported_levels():  # every ISA level: the same bits
        assert kernels.load(level, wait=True), kernels.unavailable_reason(level)
        lin = KernelLinear.pack_stored(kernels.ops(level), StoredWeight(kind, blocks, (n, kk), perm), None)
        # the packed layout is the same bytes at every level (a model keeps one packed copy: release_dense_stored)
        packed = lin.packed if packed is None else packed
        assert torch.equal(lin.packed, packed), f"{level}: another packed layout"
        alone = torch.cat([lin(x[i : i + 1]) for i in range(9)])
        for rows in (2, 5, 9):
            assert torch.equal(lin(x[:rows]), alone[:rows]), f"{level}: {rows} rows"
        first = alone if first is None else first
        assert torch.equal(alone, first), f"{level} differs from the first level"
    assert first is not None
    alone, ref = first, x.float() @ q.dequantize().t()
    torch.testing.assert_close(alone.float(), ref, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-2 if dtype == torch.bfloat16 else 1e-4)


# ---------------------------------------------------------------------------- memory at stored size
@pytest.mark.skipif(NO_KERNELS is not None, reason=f"kernels unavailable: {NO_KERNELS}")
def test_stored_weights_hold_no_dense_copy_and_decode_the_same_tokens(quantized: Any) -> None:
    """A W4A16 folder with --weights stored: each quantized projection keeps one tensor, the kernels'
    packed codes (0.75 bytes a weight for int4 in groups of 32: < 0.4x the 2 bytes of its bf16 twin),
    no dense weight beside it; the engine reports the bytes it holds; the tokens are the reference's,
    and a stored form rebuilt from the kept codes gives them again, bit for bit."""
    from tripod.engine.executor.group import resident_weight_bytes
    from tripod.layers.backends.reference import TorchBackend
    from tripod.layers.linear import KernelLinear

    folder, ref = quantized("ct-w4a16-asym-g32")
    eng = Engine(model=str(folder), dtype="float32", kv_cache_tokens=2048, chunk_size=16, max_batch_tokens=64,
                 max_running=8, weights="stored")
    net, form = eng.loaded.model, eng.runner.backend.form
    bf16_linears = stored_linears = 0
    for layer in net.layers:
        assert set(layer.stored) == {"qkv", "o", "gate_up", "down"}
        for key, mod, idx in (("qkv", layer.attn, 0), ("o", layer.attn, 1), ("gate_up", layer.mlp, 0), ("down", layer.mlp, 1)):
            sw, op = layer.stored[key], mod.ops[form][idx]
            assert getattr(mod, key).numel() == 0, f"{key}: a dense weight is still held"
            assert isinstance(op, KernelLinear) and sw.packed and op.packed.data_ptr() == sw.blocks.data_ptr()
            stored_linears += sw.blocks.numel()
            bf16_linears += 2 * sw.shape[0] * sw.shape[1]
    assert stored_linears < 0.4 * bf16_linears, (stored_linears, bf16_linears)
    # the rest (embedding, norms, the head's packed copy) is what a dense model holds too
    rest = sum(p.numel() * p.element_size() for n, p in net.named_parameters() if "layers" not in n or "norm" in n)
    assert resident_weight_bytes(net) <= stored_linears + 2 * rest
    assert eng.snapshot().weight_bytes == resident_weight_bytes(net)

    refs = [ref.greedy(p, N_TOKENS) for p in PROMPTS[:2]]
    first = [eng.generate([p], PARAMS)[0].token_ids for p in PROMPTS[:2]]
    for i, got in enumerate(first):
        check_greedy_tokens(got, refs[i], f"stored prompt {i}")
    net.release(form)  # another engine sharing the model dropped the form: rebuilt from the kept codes
    again = [eng.generate([p], PARAMS)[0].token_ids for p in PROMPTS[:2]]
    assert [list(t) for t in again] == [list(t) for t in first]
    with pytest.raises(ValueError, match="dense weights were released"):
        net.prepare(TorchBackend())


# ---------------------------------------------------------------------------- W8A8 (activations quantized)
@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w8a8_linear_is_the_checkpoints_math_and_batch_invariant(kind: str, dtype: torch.dtype) -> None:
    """tripod's W8A8 linear equals the test's reference bit for bit — compressed-tensors' own
    per-token activation quantization, the codes' product in integers, scaled once — and gives
    each row the same bits alone and in a batch."""
    pytest.importorskip("compressed_tensors")
    from tests.support.int_quant import W8A8Reference, pack_w8a8
    from tripod.layers.w8a8 import W8A8Linear

    g = torch.Generator().manual_seed(3)
    parts, _deq = pack_w8a8(torch.randn(48, 256, generator=g) / 16, kind)
    x = (torch.randn(7, 256, generator=g) * torch.logspace(-2, 2, 7).unsqueeze(1)).to(dtype)
    x[3] = 0  # an all-zero row: codes 0
    ref = W8A8Reference(parts["weight"], parts["weight_scale"], kind)(x)
    lin = W8A8Linear(parts["weight"], parts["weight_scale"].float().reshape(-1), kind, None)
    got = lin(x)
    assert got.dtype == dtype and torch.equal(got, ref)
    assert torch.equal(torch.cat([lin(x[i : i + 1]) for i in range(7)]), got)


@pytest.mark.parametrize("kind", ["int8", pytest.param("fp8", marks=pytest.mark.slow)])
def test_w8a8_checkpoint_decodes_the_reference_tokens(kind: str, tmp_path: Path, hf_tokenizer: Any) -> None:
    """A compressed-tensors W8A8 folder (int8 or FP8 weights per channel, activations dynamic per
    token) loads as W8A8 under --weights auto, keeps no dense copy, and decodes transformers'
    greedy tokens when transformers' linears run the same math (``W8A8Reference``): alone, batched,
    with prefix-cache hits. --weights dequantized is refused (it would drop the activation quantization)."""
    pytest.importorskip("compressed_tensors")
    from safetensors.torch import load_file

    from tests.support.int_quant import use_w8a8_reference
    from tripod.layers.w8a8 import W8A8Linear

    model = build_hf("llama", seed=5)
    folder, deq = save_quantized(model, tmp_path / kind, hf_tokenizer, f"w8a8-{kind}")
    model.load_state_dict(deq, strict=False)
    use_w8a8_reference(model, load_file(str(folder / "model.safetensors")), kind)
    eng = Engine(model=str(folder), dtype="float32", kv_cache_tokens=2048, chunk_size=16, max_batch_tokens=64,
                 max_running=8)
    assert eng.loaded.weights == "stored"
    assert eng.loaded.quantization == f"compressed-tensors w8a8 ({kind} weights per channel, {kind} activations dynamic per token)"
    layer, form = eng.loaded.model.layers[0], eng.runner.backend.form
    assert isinstance(layer.mlp.ops[form][0], W8A8Linear) and layer.mlp.gate_up.numel() == 0
    _check(eng, HFReference(model.eval()), f"w8a8 {kind}")
    form = eng.runner.backend.form
    if form.startswith(("kernel:", "stored:")):  # the CPU kernels' backend: INT8 products on its int8_linear
        assert (layer.mlp.ops[form][0].ops is not None) == (kind == "int8")
    with pytest.raises(ValueError, match="activations are quantized per token"):
        Engine(model=str(folder), dtype="float32", kv_cache_tokens=256, weights="dequantized")


@pytest.mark.parametrize("change, match", [
    (dict(dynamic=False), "quantized dynamically per token"),
    (dict(strategy="tensor"), "quantized dynamically per token"),
    (dict(symmetric=False), "quantized dynamically per token"),
])
def test_w8a8_schemes_tripod_does_not_run_are_refused(change: dict[str, Any], match: str, tmp_path: Path,
                                                     hf_tokenizer: Any) -> None:
    from tests.support.int_quant import quant_config

    model = build_hf("llama", seed=5)
    folder, _ = save_quantized(model, tmp_path / "w8a8", hf_tokenizer, "w8a8-int8")
    cfg = json.loads((folder / "config.json").read_text())
    q = quant_config("w8a8-int8", 8, -1, True, False, ())
    q["config_groups"]["group_0"]["input_activations"].update(change)
    cfg["quantization_config"] = q
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=match):
        Engine(model=str(folder), dtype="float32", kv_cache_tokens=256)


def test_w8a8_int8_products_run_on_integer_math_with_the_emulations_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """INT8 code products go through ``torch._int_mm`` (int32, exact) and equal the float64 sum of
    the same products bit for bit — at the codes' extremes too — alone and batched; where ``_int_mm``
    refuses a shape the float64 sum gives the same bits."""
    from tripod.layers.w8a8 import W8A8Linear, code_product

    g = torch.Generator().manual_seed(11)
    codes = torch.randint(-128, 128, (40, 1000), dtype=torch.int8, generator=g)
    codes[0] = -128  # the largest products: 128 · 128 · K
    q = torch.randint(-128, 128, (9, 1000), dtype=torch.int8, generator=g)
    q[0] = -128
    emulated = q.to(torch.float64) @ codes.to(torch.float64).t()
    calls = []
    real = torch._int_mm
    monkeypatch.setattr(torch, "_int_mm", lambda a, b: calls.append(a.shape) or real(a, b))
    assert torch.equal(code_product(q, codes), emulated) and calls
    assert emulated[0, 0] == 128 * 128 * 1000
    lin = W8A8Linear(codes, torch.rand(40, generator=g) / 100, "int8", None)
    x = torch.randn(9, 1000, generator=g) * torch.logspace(-1, 1, 9).unsqueeze(1)
    ints = lin(x)
    assert torch.equal(torch.cat([lin(x[i : i + 1]) for i in range(9)]), ints)

    def refuse(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("_int_mm: shape not supported")

    monkeypatch.setattr(torch, "_int_mm", refuse)
    assert torch.equal(code_product(q, codes), emulated)
    assert torch.equal(lin(x), ints)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w8a8_int8_on_the_cpu_kernels_gives_torchs_bits(dtype: torch.dtype) -> None:
    """On the CPU kernels' backend a W8A8 INT8 linear forms its products and scale epilogue with the
    kernels' ``int8_linear_scaled`` (up to ``KERNEL_MAX_ROWS`` rows; ``torch._int_mm`` and torch's
    float64 epilogue above): the same bits as the torch path, dynamic and static activation scales, and each row the same alone (kernel) as in
    a batch of more rows (``_int_mm``)."""
    from tripod.layers.w8a8 import KERNEL_MAX_ROWS, W8A8Linear

    if kernels.unavailable_reason() is not None or not kernels.load(wait=True):
        pytest.skip(f"tripod's CPU kernels are unavailable here: {kernels.unavailable_reason()}")
    real = kernels.ops()
    calls: list[int] = []

    class Counting:  # the kernels' ops, counting the calls of their W8A8 product
        def int8_linear(self, q: torch.Tensor, w: torch.Tensor, wsum: torch.Tensor | None) -> torch.Tensor:
            calls.append(q.shape[0])
            return real.int8_linear(q, w, wsum)

        def int8_linear_scaled(self, q: torch.Tensor, *args: Any) -> torch.Tensor:
            calls.append(q.shape[0])
            return real.int8_linear_scaled(q, *args)

    g = torch.Generator().manual_seed(8)
    codes = torch.randint(-128, 128, (40, 300), dtype=torch.int8, generator=g)
    scales = torch.rand(40, generator=g) / 100 * torch.logspace(-3, 3, 40)  # (many exponents: the roundings)
    rows = KERNEL_MAX_ROWS + 3
    x = (torch.randn(rows, 300, generator=g) * torch.logspace(-2, 1, rows).unsqueeze(1)).to(dtype)
    for input_scales in (None, torch.cat([torch.full((24,), 0.02), torch.full((16,), 0.05)])):
        torch_path = W8A8Linear(codes, scales, "int8", None, input_scales)
        lin = W8A8Linear(codes, scales, "int8", None, input_scales, ops=Counting())
        assert torch_path.ops is None and lin.ops is not None
        want = torch_path(x)
        calls.clear()
        for m in (1, 3, KERNEL_MAX_ROWS):
            assert torch.equal(lin(x[:m]), want[:m]), f"{m} rows, static={input_scales is not None}"
        assert calls and max(calls) <= KERNEL_MAX_ROWS
        calls.clear()
        assert torch.equal(lin(x), want) and not calls  # more rows: torch._int_mm, the same bits
        assert torch.equal(torch.cat([lin(x[i : i + 1]) for i in range(rows)]), want)
    assert W8A8Linear(codes.to(torch.float8_e4m3fn), scales, "fp8", None, ops=Counting()).ops is None  # FP8: torch


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w8a8_static_activation_scales_are_the_checkpoints_math(kind: str, dtype: torch.dtype) -> None:
    """Static per-tensor activation scales: a fused linear whose parts carry different ``input_scale``s
    equals, bit for bit, compressed-tensors' static quantization of each part (``W8A8Reference``),
    with activations clamped at the scale's range; each row the same alone and in a batch."""
    pytest.importorskip("compressed_tensors")
    from tests.support.int_quant import W8A8Reference, pack_w8a8
    from tripod.layers.w8a8 import W8A8Linear

    g = torch.Generator().manual_seed(4)
    parts = [pack_w8a8(torch.randn(n, 128, generator=g) / 16, kind)[0] for n in (32, 16, 16)]
    top = 127.0 if kind == "int8" else 448.0
    ins = [torch.tensor([s / top], dtype=torch.bfloat16) for s in (2.0, 3.0, 3.0)]
    x = (torch.randn(6, 128, generator=g) * torch.logspace(-2, 1, 6).unsqueeze(1)).to(dtype)
    ref = torch.cat([W8A8Reference(p["weight"], p["weight_scale"], kind, s)(x) for p, s in zip(parts, ins, strict=True)], 1)
    lin = W8A8Linear(torch.cat([p["weight"] for p in parts]),
                     torch.cat([p["weight_scale"].float().reshape(-1) for p in parts]), kind, None,
                     torch.cat([s.float().expand(p["weight"].shape[0]) for p, s in zip(parts, ins, strict=True)]))
    assert len(lin.segments) == 2  # the two parts sharing a scale quantize x once
    got = lin(x)
    assert got.dtype == dtype and torch.equal(got, ref)
    assert torch.equal(torch.cat([lin(x[i : i + 1]) for i in range(6)]), got)
    dynamic = W8A8Linear(lin.codes, lin.scales.float(), kind, None)(x)
    assert not torch.equal(dynamic, got)  # the static scales are what ran (the big rows clamp)


@pytest.mark.parametrize("kind", ["int8", pytest.param("fp8", marks=pytest.mark.slow)])
def test_w8a8_static_checkpoint_decodes_the_reference_tokens(kind: str, tmp_path: Path, hf_tokenizer: Any) -> None:
    """A compressed-tensors W8A8 folder with static activation scales (``input_scale`` per layer,
    strategy tensor, dynamic false; Q/K/V and gate/up each with their own) loads as W8A8 and decodes
    the greedy tokens of transformers running the same static math: alone, batched, with prefix-cache
    hits. A layer missing its ``input_scale`` is refused naming it."""
    pytest.importorskip("compressed_tensors")
    from safetensors.torch import load_file, save_file

    from tests.support.int_quant import use_w8a8_reference
    from tripod.layers.w8a8 import W8A8Linear

    model = build_hf("llama", seed=5)
    folder, deq = save_quantized(model, tmp_path / kind, hf_tokenizer, f"w8a8-{kind}-static")
    model.load_state_dict(deq, strict=False)
    tensors = load_file(str(folder / "model.safetensors"))
    use_w8a8_reference(model, tensors, kind)
    eng = Engine(model=str(folder), dtype="float32", kv_cache_tokens=2048, chunk_size=16, max_batch_tokens=64,
                 max_running=8)
    assert eng.loaded.quantization == f"compressed-tensors w8a8 ({kind} weights per channel, {kind} activations static per tensor)"
    op = eng.loaded.model.layers[0].attn.ops[eng.runner.backend.form][0]
    assert isinstance(op, W8A8Linear) and op.static and len(op.segments) == 3
    assert eng.loaded.quantization_detail == {
        "format": "compressed-tensors w8a8", "bits": 8, "group_size": -1,
        "activations": f"{kind} static per tensor",
        "computed_by": "tripod's CPU kernels' int8_linear (int8 x int8 -> int32, exact; AVX512-VNNI where present) "
                       "for up to 16 rows, torch._int_mm above and off the kernels (the same integers)" if kind == "int8"
        else "exact float64 emulation of the FP8 code products on the CPU"}
    _check(eng, HFReference(model.eval()), f"w8a8 {kind} static")
    del tensors["model.layers.1.mlp.up_proj.input_scale"]
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.input_scale"):
        Engine(model=str(folder), dtype="float32", kv_cache_tokens=256)


# ---------------------------------------------------------------------------- MoE experts as stored codes
@pytest.mark.skipif(NO_KERNELS is not None, reason=f"kernels unavailable: {NO_KERNELS}")
@pytest.mark.parametrize("case", _cases(["gptq-moe-experts", "ct-mixtral-experts", "awq-qwen2-moe-experts"],
                                        "gptq-moe-experts"))
def test_moe_experts_run_as_stored_codes_at_stored_size(case: str, quantized: Any) -> None:
    """A GPTQ Qwen3-MoE (slow: a compressed-tensors Mixtral with zero points, an AWQ Qwen2-MoE with its
    shared expert) with --weights stored: every routed expert's gate/up and down run as its
    stored int4 codes (Q4_0 / Q4_1 / Q4_K blocks) on the CPU kernels' stored linear (one per expert, over the rows routed to
    it), no dense expert stack is held and the experts' memory is their codes' (0.75 bytes a weight,
    < 0.25x float32); the greedy tokens are the --weights dequantized run's, token for token, each
    prompt alone and all in one batch, bit for bit."""
    from tripod.engine.executor.group import resident_weight_bytes
    from tripod.layers.linear import KernelLinear
    from tripod.layers.moe import MoE

    folder, ref = quantized(case)
    kw: dict[str, Any] = dict(model=str(folder), dtype="float32", kv_cache_tokens=2048, chunk_size=16,
                              max_batch_tokens=64, max_running=8)
    eng = Engine(**kw, weights="stored")
    net, form = eng.loaded.model, eng.runner.backend.form
    moe = [layer.mlp.experts for layer in net.layers if isinstance(layer.mlp, MoE)]
    assert moe
    codes = dense = 0
    for ex in moe:
        assert ex.gate_up.numel() == 0 and ex.down.numel() == 0, "a dense expert stack is still held"
        ops = ex.ops[form]
        assert len(ops) == 2 * ex.num_experts == len(ex.stored)
        for e in range(ex.num_experts):
            for j, name in enumerate(("gate_up", "down")):
                sw, op = ex.stored[f"{name}.{e}"], ops[2 * e + j]
                # (the kernels pack int4 groups whose scales fit fp16 as Q4_0 / Q4_1 blocks: narrowed_kind)
                assert isinstance(op, KernelLinear) and op.fmt in ("q4_0", "q4_1", "q4_k") and sw.kind == op.fmt.upper()
                assert sw.packed and op.packed.data_ptr() == sw.blocks.data_ptr()  # one copy of the codes
                codes += sw.blocks.numel()
                dense += 4 * sw.shape[0] * sw.shape[1]
    assert sum(resident_weight_bytes(ex) for ex in moe) == codes < 0.25 * dense, (codes, dense)
    for layer in net.layers:  # a shared expert (Qwen2-MoE) runs its stored codes too, no dense copy
        shared = layer.mlp.shared if isinstance(layer.mlp, MoE) else None
        if shared is not None:
            assert set(layer.mlp.stored) == {"gate_up", "down"} and shared.gate_up.numel() == shared.down.numel() == 0
            assert all(isinstance(op, KernelLinear) and op.fmt in ("q4_0", "q4_1", "q4_k") for op in shared.ops[form])
    # loaded for the stored form only (what the engine does here), the stacks are never dequantized at all
    from tripod.loader import load_model

    early = load_model(str(folder), torch.float32, torch.device("cpu"), weights="stored", stored_only=True).model
    for layer in early.layers:
        if isinstance(layer.mlp, MoE):
            ex = layer.mlp.experts
            assert ex.gate_up.numel() == ex.down.numel() == 0 and len(ex.stored) == 2 * ex.num_experts

    deq = Engine(**kw, weights="dequantized")
    deq_net = deq.loaded.model
    assert sum(resident_weight_bytes(layer.mlp.experts) for layer in deq_net.layers if isinstance(layer.mlp, MoE)) == dense
    assert resident_weight_bytes(net) + (dense - codes) // 2 < resident_weight_bytes(deq_net)
    assert eng.snapshot().weight_bytes == resident_weight_bytes(net)

    want = [deq.generate([p], PARAMS)[0].token_ids for p in PROMPTS]
    for i, p in enumerate(PROMPTS):
        check_greedy_tokens(want[i], ref.greedy(p, N_TOKENS), f"dequantized prompt {i}")
    _check(eng, ref, "moe experts stored")
    got = [out.token_ids for out in eng.generate(PROMPTS, PARAMS)]
    assert [list(t) for t in got] == [list(t) for t in want], "stored experts differ from the dequantized run"
    net.release(form)  # another engine sharing the model dropped the form: rebuilt from the kept packed codes
    assert list(eng.generate([PROMPTS[0]], PARAMS)[0].token_ids) == list(want[0])
    assert all(ex.ops[form][0].packed.data_ptr() == ex.stored["gate_up.0"].blocks.data_ptr() for ex in moe)
    # the experts alone: each row's output has the same bits in a batch of 7 as alone (the kernels'
    # rows are independent; every row sums its experts in the same order)
    g = torch.Generator().manual_seed(3)
    ex = moe[0]
    x = torch.randn(7, ex.gate_up.shape[2], generator=g)
    idx = torch.stack([torch.randperm(ex.num_experts, generator=g)[:2] for _ in range(7)])
    w = torch.rand(7, 2, generator=g)
    batched = ex(x, w, idx, form)
    for i in range(7):
        assert torch.equal(ex(x[i : i + 1], w[i : i + 1], idx[i : i + 1], form)[0], batched[i]), i
    # bf16 activations (what --weights auto picks): the experts and the router give each row the same
    # bits alone as in a batch. (Not compared as whole-request tokens: these tiny models' 16-wide heads
    # are not a shape the attention kernel covers, so their attention runs on torch's ops, whose bits
    # depend on the batch.)
    bf16 = Engine(**{**kw, "dtype": "bfloat16"}, weights="stored")
    bform = bf16.runner.backend.form
    bmoe = [layer.mlp for layer in bf16.loaded.model.layers if isinstance(layer.mlp, MoE)]
    assert all(isinstance(m.experts.ops[bform][0], KernelLinear) for m in bmoe)
    xb = x.bfloat16()
    batched = bmoe[0].experts(xb, w, idx, bform)
    router = bmoe[0].gate_ops[bform][0]
    logits = router(xb.float())
    for i in range(7):
        assert torch.equal(bmoe[0].experts(xb[i : i + 1], w[i : i + 1], idx[i : i + 1], bform)[0], batched[i]), i
        assert torch.equal(router(xb[i : i + 1].float())[0], logits[i]), i
    with pytest.raises(ValueError, match="dense expert weights were released"):
        x = torch.zeros(1, moe[0].gate_up.shape[2])
        moe[0](x, torch.ones(1, 1), torch.zeros(1, 1, dtype=torch.long), "dense")
