"""compressed-tensors NVFP4 (``nvfp4-pack-quantized``): FP4 E2M1 weight codes two a byte, an FP8
E4M3 scale per 16 inputs over a float32 global scale; weight-only (NVFP4A16, read into the integer
form ``GroupQuantized``) or with FP4 input activations (W4A4, ``llmcompressor``'s ``NVFP4`` scheme:
read into ``Nvfp4W4A4Weight`` for ``layers/w4a4.py``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from tripod.loader.hf_quant import (
    SUPPORTED,
    CompressedTensorsFormat,
    GroupQuantized,
    IntScheme,
    QuantizedCheckpointError,
    check_shape,
    float_scales,
    need_tensor,
)


def scheme(gname: str, g: Mapping[str, Any]) -> IntScheme:
    """NVFP4A16 (weights only): FP4 E2M1 codes, an FP8 E4M3 scale per 16 inputs, a float32 global
    scale; NVFP4 (W4A4, ``llmcompressor``'s scheme): the input activations quantized the same way, their
    group scales computed per row (``dynamic: local``) over a static ``input_global_scale``."""
    if g.get("output_activations"):
        raise QuantizedCheckpointError(
            f"compressed-tensors config group {gname}: NVFP4 with quantized output activations is not supported "
            f"(supported: {SUPPORTED})")
    w = g.get("weights") or {}
    if w.get("type") != "float" or w.get("num_bits") != 4 or w.get("group_size") != 16:
        raise QuantizedCheckpointError(
            f"compressed-tensors config group {gname}: nvfp4-pack-quantized needs 4-bit float weights in groups of 16"
        )
    a = g.get("input_activations")
    if not a:
        return IntScheme(4, 16, True, "nvfp4")
    if (a.get("type") != "float" or a.get("num_bits") != 4 or a.get("group_size") != 16
            or a.get("symmetric", True) is not True or a.get("strategy", "tensor_group") != "tensor_group"
            or str(a.get("dynamic")).lower() != "local"):
        raise QuantizedCheckpointError(
            f"compressed-tensors config group {gname}: NVFP4 input activations {dict(a)} are not supported; tripod "
            "runs NVFP4 W4A4 as llmcompressor's NVFP4 scheme writes it: symmetric 4-bit float activations, strategy "
            "tensor_group, group_size 16, dynamic 'local' (FP8 group scales per row over a static input_global_scale)")
    return IntScheme(4, 16, True, "nvfp4-w4a4")


def unpack_nvfp4(tensors: Mapping[str, torch.Tensor], module: str) -> GroupQuantized:
    """NVFP4: ``weight_packed`` uint8 ``[N, K / 2]`` (input 2i in the low nibble: sign bit 3, E2M1
    magnitude index in bits 0-2), ``weight_scale`` float8_e4m3fn ``[N, K / 16]``,
    ``weight_global_scale`` float32 ``[1]``; ``W = fp4 * (scale / global_scale)`` in float32.
    Every E2M1 value is an integer over 2 (0, ±0.5 … ±6 = ±12 / 2), so this is the integer form
    with codes ``2 * fp4 + 128`` (8-bit, zero point 128) and scales ``(scale / global) / 2``, exactly."""
    f = "compressed-tensors nvfp4"
    packed = need_tensor(tensors, module + ".weight_packed", f)
    if packed.dtype != torch.uint8:
        raise QuantizedCheckpointError(f"{f} checkpoint: {module}.weight_packed is {packed.dtype}, expected uint8")
    n, k = int(packed.shape[0]), int(packed.shape[1]) * 2
    scale = need_tensor(tensors, module + ".weight_scale", f)
    check_shape(scale, (n, k // 16), module + ".weight_scale", f, f"{n} outputs x {k} inputs / 16")
    glob = need_tensor(tensors, module + ".weight_global_scale", f)
    if glob.numel() != 1:
        raise QuantizedCheckpointError(f"{f} checkpoint: {module}.weight_global_scale must be one value")
    half_steps = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12], dtype=torch.int32)  # E2M1 magnitudes x 2
    nib = torch.stack(((packed & 15), (packed >> 4)), dim=-1).reshape(n, k).to(torch.int32)
    val = torch.where(nib >= 8, -half_steps[nib & 7], half_steps[nib & 7])
    eff = scale.to(torch.float32) / glob.to(torch.float32).reshape(())  # compressed-tensors' float32 division
    return GroupQuantized((val + 128).to(torch.uint8), eff * 0.5, torch.full((n, k // 16), 128, dtype=torch.int32),
                          torch.arange(k) // 16, 8)


@dataclass(frozen=True, slots=True)
class Nvfp4W4A4Weight:
    """One NVFP4 W4A4 linear as stored, for ``layers/w4a4.py``: ``codes`` int8 ``2 · fp4`` ``[N, K]``
    (exact: every E2M1 value is an integer over 2), ``scales`` float32 ``[N, K / 16]`` (the E4M3
    ``weight_scale`` over ``weight_global_scale``, the float32 division compressed-tensors makes) and
    ``input_global_scale`` (float32, one value: the activations' static global scale)."""

    codes: torch.Tensor
    scales: torch.Tensor
    input_global_scale: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.codes.shape[0]), int(self.codes.shape[1])

    def dequantize(self) -> torch.Tensor:
        """float32 ``fp4 · scale`` (the model's dense parameter until the W4A4 form is built; never computed
        with: these checkpoints always quantize their activations)."""
        n, k = self.shape
        return ((self.codes.to(torch.float32) * 0.5).view(n, k // 16, 16) * self.scales.unsqueeze(-1)).reshape(n, k)

    @staticmethod
    def unpack(tensors: Mapping[str, torch.Tensor], module: str) -> Nvfp4W4A4Weight:
        gq = unpack_nvfp4(tensors, module)  # codes 2 · fp4 + 128, scales (scale / global) / 2
        f = "compressed-tensors nvfp4 w4a4"
        glob = float_scales(need_tensor(tensors, module + ".input_global_scale", f), module + ".input_global_scale", f)
        glob = glob.reshape(-1)
        if glob.numel() != 1 or not bool(torch.isfinite(glob).all()) or not bool((glob > 0).all()):
            raise QuantizedCheckpointError(f"{f} checkpoint: {module}.input_global_scale must be one positive finite "
                                           f"value (the activations' static global scale), got {glob.tolist()[:4]}")
        codes = (gq.codes.to(torch.int16) - 128).to(torch.int8)
        return Nvfp4W4A4Weight(codes, gq.scales * 2.0, glob.reshape(()).contiguous())


class Nvfp4Format(CompressedTensorsFormat):
    """compressed-tensors folders with ``nvfp4-pack-quantized`` config groups (beside ``pack-quantized``
    ones for NVFP4A16): ``CompressedTensorsFormat`` with the NVFP4 schemes and tensors read here."""

    def _nvfp4(self, gname: str, g: Mapping[str, Any]) -> IntScheme:
        return scheme(gname, g)

    def _unpack_fp4(self, tensors: Mapping[str, torch.Tensor], module: str, sc: IntScheme) -> Any:
        return unpack_nvfp4(tensors, module) if sc.kind == "nvfp4" else Nvfp4W4A4Weight.unpack(tensors, module)
