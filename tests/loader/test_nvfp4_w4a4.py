"""NVFP4 W4A4 (compressed-tensors ``nvfp4-pack-quantized`` with FP4 input activations): the
activations quantized exactly as compressed-tensors does, the product of the exact FP4 values,
rows batch-invariant; a checkpoint made by compressed-tensors itself decodes the greedy tokens of
compressed-tensors' own fake-quantized forward (float32); malformed or other schemes refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import HFReference
from tests.support.tiny_models import build_hf
from tripod import Engine

pytest.importorskip("compressed_tensors")


def _args() -> Any:
    from compressed_tensors.quantization import preset_name_to_scheme

    return preset_name_to_scheme("NVFP4", ["Linear"])


def _ct_quantize(x: torch.Tensor, glob: torch.Tensor, args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors' own dynamic NVFP4 quantization of ``x``: (FP4 values, effective scales)."""
    from compressed_tensors.quantization.lifecycle.forward import _process_quantization
    from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp

    scale, zp = compute_dynamic_scales_and_zp(value=x, args=args, module=None, global_scale=glob)
    q = _process_quantization(x, scale, zp, args, do_quantize=True, do_dequantize=False, global_scale=glob)
    return q.float(), scale / glob


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w4a4_linear_is_the_checkpoints_math_and_batch_invariant(dtype: torch.dtype) -> None:
    """The activations' FP4 values and E4M3 scales are compressed-tensors' own, bit for bit (a zero
    row, a zero group, groups whose scale saturates E4M3); the linear equals the float64 product of
    compressed-tensors' dequantized activations and weights up to float64 rounding, and
    compressed-tensors' fake-quantized ``nn.Linear`` forward up to its float32 sum; each row has the
    same bits alone, in a batch and in a fused linear whose parts carry different global scales."""
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationStatus,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    from tripod.layers.w4a4 import W4A4Linear, quantize_nvfp4
    from tripod.loader.hf_nvfp4 import Nvfp4W4A4Weight

    args = _args().input_activations
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(9, 128, generator=g) * torch.logspace(-3, 2, 9).unsqueeze(1)).to(dtype)
    x[2] = 0
    x[3, 16:32] = 0
    glob = torch.tensor([448.0 * 6.0 / float(x.float().abs().max()) * 4.0])  # the largest groups clamp at 448
    codes, eff = quantize_nvfp4(x, glob)
    fp4, ct_eff = _ct_quantize(x, glob, args)
    assert torch.equal(codes.float() / 2, fp4) and torch.equal(eff, ct_eff)
    assert bool(torch.isclose(ct_eff * glob, torch.tensor(448.0), rtol=1e-6).any()) and bool((codes[2] == 0).all()) and bool((codes[3, 16:32] == 0).all())

    # the weights: a linear quantized and calibrated by compressed-tensors, unpacked as tripod stores it
    mod = torch.nn.Sequential(torch.nn.Linear(128, 48, bias=False))
    torch.nn.init.normal_(mod[0].weight, generator=g)
    apply_quantization_config(mod, QuantizationConfig(config_groups={"g": _args()}))
    lin = mod[0]
    with torch.no_grad():
        lin.input_global_scale.copy_(glob)
        lin.weight_global_scale.copy_(generate_gparam(lin.weight.min(), lin.weight.max()))
        groups = lin.weight.unflatten(-1, (-1, 16))
        s, zp = calculate_qparams(groups.amin(-1), groups.amax(-1), _args().weights, global_scale=lin.weight_global_scale)
        lin.weight_scale.copy_(s)
        lin.weight_zero_point.copy_(zp)
    lin.quantization_status = QuantizationStatus.FROZEN
    w_fp4, w_eff = _ct_quantize(lin.weight.detach(), lin.weight_global_scale.detach(), _args().weights)
    packed_codes = (w_fp4 * 2).to(torch.int8)
    ours = W4A4Linear(packed_codes, w_eff, glob.expand(48), None)
    got = ours(x)
    assert got.dtype == dtype
    # float64: compressed-tensors' dequantized activations (exact FP4 x scale) times the dequantized weights
    xd = (fp4.view(9, 8, 16).double() * ct_eff.double().unsqueeze(-1)).reshape(9, 128)
    wd = (w_fp4.view(48, 8, 16).double() * w_eff.double().unsqueeze(-1)).reshape(48, 128)
    exact = xd @ wd.t()
    scale = xd.abs() @ wd.abs().t()  # the size of the sum's terms
    unit = 2.0**-24 if dtype == torch.float32 else 2.0**-8  # one rounding to the run dtype
    assert bool(((got.double() - exact).abs() <= unit * exact.abs() + 1e-12 * scale).all())
    if dtype == torch.float32:  # compressed-tensors' own module forward: fake-quantized x and W, a float32 sum
        with torch.no_grad():
            fq = mod(x)
        assert bool(((got - fq).abs().double() <= 1e-5 * scale + 1e-30).all())
    assert torch.equal(torch.cat([ours(x[i : i + 1]) for i in range(9)]), got)

    # a fused linear whose parts carry different activation global scales (Q/K/V calibrated apart)
    half = glob / 3
    fused = W4A4Linear(torch.cat([packed_codes, packed_codes[:16]]), torch.cat([w_eff, w_eff[:16]]),
                       torch.cat([glob.expand(48), half.expand(16)]), None)
    assert len(fused.segments) == 2
    out = fused(x)
    assert torch.equal(out[:, :48], got)
    assert torch.equal(out[:, 48:], W4A4Linear(packed_codes[:16], w_eff[:16], half.expand(16), None)(x))
    assert torch.equal(torch.cat([fused(x[i : i + 1]) for i in range(9)]), out)
    # the dense form the loader holds until the W4A4 form is built: compressed-tensors' fake-quantized weight
    deq = Nvfp4W4A4Weight(packed_codes, w_eff, glob.reshape(())).dequantize()
    assert torch.equal(deq, (w_fp4.view(48, 8, 16) * w_eff.unsqueeze(-1)).reshape(48, 128))


@pytest.fixture(scope="module")
def w4a4_folder(tmp_path_factory: pytest.TempPathFactory, hf_tokenizer: Any) -> tuple[Path, HFReference]:
    from tests.support.nvfp4_ct import save_nvfp4_w4a4

    folder, reference = save_nvfp4_w4a4(build_hf("llama", seed=5), tmp_path_factory.mktemp("nvfp4-w4a4"), hf_tokenizer)
    return folder, HFReference(reference)


def test_nvfp4_w4a4_checkpoint_decodes_compressed_tensors_fake_quant_tokens(w4a4_folder: Any) -> None:
    """A folder compressed by compressed-tensors (``NVFP4`` preset, calibrated global scales) loads as
    W4A4 under ``--weights auto``, keeps no dense copy of its projections, says what it runs, and decodes
    the greedy tokens of compressed-tensors' own fake-quantized forward in float32 — alone, batched,
    with prefix-cache hits. ``--weights dequantized`` is refused (it would drop the FP4 activations)."""
    from tests.loader.test_quantized_hf import _check
    from tripod.layers.w4a4 import W4A4Linear

    folder, ref = w4a4_folder
    eng = Engine(model=str(folder), dtype="float32", kv_cache_tokens=2048, chunk_size=16, max_batch_tokens=64,
                 max_running=8)
    assert eng.loaded.weights == "stored"
    assert eng.loaded.quantization.startswith("compressed-tensors nvfp4-pack-quantized (nvfp4 w4a4")
    assert eng.loaded.quantization_detail == {
        "format": "compressed-tensors nvfp4-pack-quantized", "bits": 4, "group_size": 16,
        "activations": "fp4 e2m1 dynamic per row and group of 16 (fp8 e4m3 scales, static global scale)",
        "computed_by": "exact FP4 x FP4 code products per group of 16 (float32), group scales applied in float64 on the CPU"}
    layer, form = eng.loaded.model.layers[0], eng.runner.backend.form
    assert isinstance(layer.mlp.ops[form][0], W4A4Linear) and layer.mlp.gate_up.numel() == 0
    assert isinstance(layer.attn.ops[form][0], W4A4Linear)
    _check(eng, ref, "nvfp4 w4a4")
    with pytest.raises(ValueError, match="activations are quantized"):
        Engine(model=str(folder), dtype="float32", kv_cache_tokens=256, weights="dequantized")


@pytest.mark.parametrize("change, match", [
    ({"dynamic": True}, "NVFP4 input activations"),
    ({"group_size": 32}, "NVFP4 input activations"),
    ({"strategy": "group"}, "NVFP4 input activations"),
    (None, "beside weight-only ones"),
    ("drop", r"model\.layers\.1\.mlp\.up_proj\.input_global_scale"),
])
def test_nvfp4_w4a4_schemes_and_tensors_tripod_does_not_run_are_refused(change: Any, match: str, w4a4_folder: Any,
                                                                        tmp_path: Path) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    src, _ = w4a4_folder
    folder = Path(shutil.copytree(src, tmp_path / "copy"))
    cfg = json.loads((folder / "config.json").read_text())
    q = cfg["quantization_config"]
    if change == "drop":
        tensors = load_file(str(folder / "model.safetensors"))
        del tensors["model.layers.1.mlp.up_proj.input_global_scale"]
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    elif change is None:  # a weight-only NVFP4A16 group beside the W4A4 one
        extra = json.loads(json.dumps(q["config_groups"]["group_0"]))
        extra["input_activations"], extra["targets"] = None, ["re:.*down_proj"]
        q["config_groups"]["group_1"] = extra
    else:
        q["config_groups"]["group_0"]["input_activations"].update(change)
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=match):
        Engine(model=str(folder), dtype="float32", kv_cache_tokens=256)
