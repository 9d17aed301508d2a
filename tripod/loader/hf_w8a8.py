"""compressed-tensors W8A8 checkpoints (``int-quantized`` INT8, ``float-quantized`` FP8 E4M3):
8-bit weights with a scale per output channel or per tensor, whose input activations the model
quantizes dynamically per token or with a static per-tensor scale (``input_scale``) (``layers/w8a8.py`` runs them). Read here into ``W8A8Weight``s,
refused with the reason for any scheme tripod does not run exactly as the checkpoint means."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from tripod.loader import hf_nvfp4, hf_quant
from tripod.loader.hf_quant import (
    SUPPORTED,
    W8A8_FORMATS,
    CompressedTensorsFormat,
    IntFormat,
    IntScheme,
    QuantizedCheckpointError,
    TargetGroup,
    float_scales,
    need_tensor,
)


def parse(config: Mapping[str, Any]) -> IntFormat | None:
    """``hf_quant.parse``, with compressed-tensors W8A8 folders (every config group ``int-quantized``
    or ``float-quantized``) read as ``W8A8Format``."""
    q = config.get("quantization_config") or {}
    if str(q.get("quant_method", "")).lower() == "compressed-tensors":
        formats = {g.get("format") or q.get("format") for g in (q.get("config_groups") or {}).values()}
        if formats and formats <= set(W8A8_FORMATS):
            return W8A8Format(q)
        if "nvfp4-pack-quantized" in formats:
            return hf_nvfp4.Nvfp4Format(q)
    return hf_quant.parse(config)


@dataclass(frozen=True, slots=True)
class W8A8Weight:
    """One W8A8 linear's weight as stored: ``codes`` int8 or float8_e4m3fn ``[N, K]`` and float32
    ``scales`` ``[N]`` (a per-tensor scale repeated); ``kind`` "int8" or "fp8"."""

    codes: torch.Tensor
    scales: torch.Tensor
    kind: str
    # static activations: the checkpoint's ``input_scale`` (float32, one value); None: dynamic per token
    input_scale: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.codes.shape[0]), int(self.codes.shape[1])

    def dequantize(self) -> torch.Tensor:
        """float32 ``codes * scale`` (what the model's dense parameter holds until the W8A8 form is
        built; never computed with: these checkpoints always quantize their activations)."""
        return self.codes.to(torch.float32) * self.scales.unsqueeze(1)


class W8A8Format(IntFormat):
    """compressed-tensors ``int-quantized`` / ``float-quantized`` (W8A8): ``weight`` int8 or
    float8_e4m3fn ``[N, K]``, ``weight_scale`` ``[N, 1]`` (strategy ``channel``) or one value
    (``tensor``), symmetric; input activations quantized to the same type dynamically per token
    or statically with the checkpoint's per-tensor ``input_scale`` (``layers/w8a8.py`` runs both).
    Asymmetric weights or activations, per-group or per-channel activations, and groups are refused,
    naming what is supported."""

    name = "compressed-tensors W8A8"
    marker = "weight_scale"
    aux = ("weight_zero_point", "input_scale", "input_zero_point")
    weight_is_codes = True
    quantizes_activations = True

    def __init__(self, q: Mapping[str, Any]) -> None:
        self.groups: list[TargetGroup] = []
        self.kinds: set[str] = set()
        self.strategies: set[str] = set()
        self.activations: set[str] = set()  # "dynamic per token" / "static per tensor"
        for gname, g in (q.get("config_groups") or {}).items():
            w, a = g.get("weights") or {}, g.get("input_activations") or {}
            fmt = g.get("format") or q.get("format")
            want = "int" if fmt == "int-quantized" else "float"
            what = f"compressed-tensors {fmt} (config group {gname})"
            if w.get("type", want) != want or w.get("num_bits") != 8 or not w.get("symmetric", True):
                raise QuantizedCheckpointError(f"{what}: needs symmetric 8-bit {want} weights (supported: {SUPPORTED})")
            if w.get("strategy") not in ("channel", "tensor") or w.get("dynamic"):
                raise QuantizedCheckpointError(
                    f"{what}: weight strategy {w.get('strategy')!r} is not supported (channel or tensor; supported: {SUPPORTED})")
            if g.get("output_activations"):
                raise QuantizedCheckpointError(f"{what}: output activation quantization is not supported")
            dynamic = a.get("dynamic") is True and a.get("strategy") == "token"
            static = a.get("dynamic") is False and a.get("strategy") == "tensor"
            if (not a or a.get("type", want) != want or a.get("num_bits") != 8 or not a.get("symmetric", True)
                    or not (dynamic or static)):
                raise QuantizedCheckpointError(
                    f"{what}: input activations {dict(a) if a else None} are not supported; tripod runs W8A8 with "
                    f"symmetric 8-bit {want} activations quantized dynamically per token, or with a static "
                    "per-tensor scale (strategy 'tensor', dynamic false)")
            self.activations.add("dynamic per token" if dynamic else "static per tensor")
            self.kinds.add("int8" if want == "int" else "fp8")
            self.strategies.add(str(w.get("strategy")))
            self.groups.append(TargetGroup(CompressedTensorsFormat._targets(gname, g), IntScheme(8, -1, True, f"w8a8-{want}" + ("" if dynamic else "-static"))))
        if not self.groups:
            raise QuantizedCheckpointError("compressed-tensors quantization_config has no config_groups")
        self.ignore = tuple(q.get("ignore") or ())

    scheme_for = CompressedTensorsFormat.scheme_for
    _matches = staticmethod(CompressedTensorsFormat._matches)

    def schemes(self) -> list[IntScheme]:
        return [g.scheme for g in self.groups]

    def not_stored_reason(self) -> str | None:
        return None  # always the W8A8 form: its activations are quantized as the checkpoint says

    def describe(self) -> str:
        kinds = "/".join(sorted(self.kinds))
        return (f"compressed-tensors w8a8 ({kinds} weights per {'/'.join(sorted(self.strategies))}, "
                f"{kinds} activations {'/'.join(sorted(self.activations))})")

    def unpack(self, tensors: Mapping[str, torch.Tensor], module: str) -> W8A8Weight:  # type: ignore[override]
        f = "compressed-tensors W8A8"
        w = need_tensor(tensors, module + ".weight", f)
        scheme = self.scheme_for(module)
        assert scheme is not None
        want = torch.int8 if scheme.kind.startswith("w8a8-int") else torch.float8_e4m3fn
        if w.dtype != want or w.ndim != 2:
            raise QuantizedCheckpointError(f"{f} checkpoint: {module}.weight is {w.dtype} {tuple(w.shape)}, "
                                           f"expected {want} [outputs, inputs]")
        n = int(w.shape[0])
        scale = float_scales(need_tensor(tensors, module + ".weight_scale", f), module + ".weight_scale", f).reshape(-1)
        if scale.numel() not in (1, n):
            raise QuantizedCheckpointError(f"{f} checkpoint: {module}.weight_scale has {scale.numel()} values, "
                                           f"expected {n} (one per output channel) or 1 (per tensor)")
        zp = tensors.get(module + ".weight_zero_point")
        if zp is not None and bool(zp.to(torch.float32).ne(0).any()):
            raise QuantizedCheckpointError(f"{f} checkpoint: {module} has non-zero weight zero points (asymmetric W8A8)")
        in_scale = tensors.get(module + ".input_scale")
        if not scheme.kind.endswith("-static"):
            if in_scale is not None:
                raise QuantizedCheckpointError(f"{f} checkpoint: {module}.input_scale is a static activation scale; "
                                               "the config says dynamic per-token")
        else:
            in_scale = need_tensor(tensors, module + ".input_scale", f)
            in_scale = float_scales(in_scale, module + ".input_scale", f).reshape(-1)
            if in_scale.numel() != 1 or not bool(torch.isfinite(in_scale).all()) or not bool((in_scale > 0).all()):
                raise QuantizedCheckpointError(f"{f} checkpoint: {module}.input_scale must be one positive finite value "
                                               f"(a static per-tensor activation scale), got {in_scale.tolist()[:4]}")
            zp = tensors.get(module + ".input_zero_point")
            if zp is not None and bool(zp.to(torch.float32).ne(0).any()):
                raise QuantizedCheckpointError(f"{f} checkpoint: {module} has a non-zero input zero point (asymmetric activations)")
            in_scale = in_scale.reshape(()).contiguous()
        return W8A8Weight(w.contiguous(), scale.expand(n).contiguous(), "int8" if want == torch.int8 else "fp8", in_scale)
