"""NVFP4 W4A4 checkpoints made by compressed-tensors itself (no llmcompressor here, no hub): its
``NVFP4`` preset scheme applied to a tiny transformers model, calibrated the way llmcompressor's
round-to-nearest NVFP4 recipe does (the static-min-max global scale of each linear's inputs over a
calibration batch; the weights' global scale from their min/max, shared by Q/K/V and by gate/up as
llmcompressor fuses them; E4M3 group scales from ``calculate_qparams``), then compressed by
``ModelCompressor`` into ``nvfp4-pack-quantized`` and saved.

The uncompressed model (status frozen) is returned too: its forward is compressed-tensors' own
fake-quantization — each linear quantizes its input to FP4 per row and group of 16 and multiplies it
with the FP4 weights, in float32 — the float reference tripod's greedy tokens are checked against
(transformers' own loading of the folder decompresses the weights to bf16 whatever ``torch_dtype``
says, so it cannot run in float32 on the CPU).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch


def calibrate_nvfp4(model: Any, calibration: torch.Tensor) -> dict[str, Any]:
    """Apply compressed-tensors' ``NVFP4`` scheme to ``model``'s linears (``lm_head`` left out) and fill
    its global and group scales; returns the quantized linears by name (status frozen)."""
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationStatus,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    cfg = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme("NVFP4", ["Linear"])}, ignore=["lm_head"])
    apply_quantization_config(model, cfg)
    lins = {n: m for n, m in model.named_modules() if getattr(m, "quantization_scheme", None) is not None}
    seen: dict[Any, tuple[torch.Tensor, torch.Tensor]] = {}

    def observe(mod: Any, args: tuple[torch.Tensor, ...]) -> None:  # static min-max of the raw inputs
        x = args[0].detach()
        lo, hi = seen.get(mod, (torch.zeros(()), torch.zeros(())))
        seen[mod] = (torch.minimum(lo, x.min()), torch.maximum(hi, x.max()))

    hooks = [m.register_forward_pre_hook(observe) for m in lins.values()]
    for m in lins.values():
        m.quantization_enabled = False
    with torch.no_grad():
        model(calibration)
    for h in hooks:
        h.remove()
    with torch.no_grad():
        for m in lins.values():
            m.quantization_enabled = True
            m.input_global_scale.copy_(generate_gparam(*seen[m]))
            m.weight_global_scale.copy_(generate_gparam(m.weight.min(), m.weight.max()))
        for layer in model.model.layers:  # llmcompressor: fused projections share the smallest weight global scale
            for mods in ((layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj),
                         (layer.mlp.gate_proj, layer.mlp.up_proj)):
                g = torch.min(torch.cat([x.weight_global_scale for x in mods]))
                for x in mods:
                    x.weight_global_scale.fill_(g)
        for m in lins.values():
            groups = m.weight.unflatten(-1, (-1, 16))
            s, zp = calculate_qparams(groups.amin(-1), groups.amax(-1), m.quantization_scheme.weights,
                                      global_scale=m.weight_global_scale)
            m.weight_scale.copy_(s)
            m.weight_zero_point.copy_(zp)
            m.quantization_status = QuantizationStatus.FROZEN
    return lins


def save_nvfp4_w4a4(model: Any, folder: Path, tokenizer: Any, seed: int = 0) -> tuple[Path, Any]:
    """Quantize ``model`` to NVFP4 W4A4 with compressed-tensors, save it compressed into ``folder`` with
    ``tokenizer``; returns the folder and the fake-quantized float32 model (compressed-tensors' forward)."""
    from compressed_tensors.compressors import ModelCompressor

    g = torch.Generator().manual_seed(seed)
    calibrate_nvfp4(model, torch.randint(3, int(model.config.vocab_size), (2, 32), generator=g))
    reference = copy.deepcopy(model).eval()
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="nvfp4-pack-quantized")
    compressor.compress_model(model)
    model.save_pretrained(str(folder))
    compressor.update_config(str(folder))
    tokenizer.save_pretrained(str(folder))
    return folder, reference
