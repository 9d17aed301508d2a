"""The structured description of a loaded model's quantization (``/v1/models``'s
``quantization_detail`` and the start-up log): the format as stored, its bits and group size, how
activations are quantized, and what computes the products. Built once by ``load_model`` from the
open source and the stored weights it handed the model."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tripod.layers.linear import StoredWeight, narrowed_kind
from tripod.loader.gguf_loader import GGUFFile
from tripod.loader.hf_loader import HFFolder

# What computes each stored kind (layers/linear.py make_linear; layers/w8a8.py).
_STORED_COMPUTE = {
    "W8A8_INT8": "tripod's CPU kernels' int8_linear (int8 x int8 -> int32, exact; AVX512-VNNI where present) for up to 16 rows, torch._int_mm above and off the kernels (the same integers)",
    "W8A8_FP8": "exact float64 emulation of the FP8 code products on the CPU",
    "W4A4_NVFP4": "exact FP4 x FP4 code products per group of 16 (float32), group scales applied in float64 on the CPU",
}


def _one_or_list(values: set[Any]) -> Any:
    ordered = sorted(values, key=lambda v: (v is None, v))
    return ordered[0] if len(ordered) == 1 else ordered


def quantization_card(src: GGUFFile | HFFolder, weights: str, stored: Mapping[str, Any]) -> dict[str, Any] | None:
    """``{"format", "bits", "group_size", "activations", "computed_by"}`` (``group_size`` -1: one
    scale per output channel; null: per tensor or not a grouped format; a list where config groups
    differ), or None for an unquantized checkpoint."""
    # (the kind the kernels run: a Q4_K-form weight may run as the Q4_0 / Q4_1 form holding its values)
    kinds = sorted({narrowed_kind(sw) if isinstance(sw, StoredWeight) else getattr(sw, "kind", "")
                    for sw in stored.values()})
    if weights == "stored" and kinds:
        computed = "; ".join(_STORED_COMPUTE.get(k, f"tripod's kernels on the stored {k} blocks") for k in kinds)
    elif weights == "fp8":
        computed = "FP8 weights dequantized per block band inside each matmul (w8a16)"
    else:
        computed = "dense linears on the weights dequantized at load"
    card: dict[str, Any] = {"bits": None, "group_size": None, "activations": None, "computed_by": computed}
    if isinstance(src, GGUFFile):
        return {"format": f"gguf {src.quantization}", **card}
    fmt = src.int_format
    if fmt is not None:
        schemes = fmt.schemes()
        w8a8 = bool(getattr(fmt, "quantizes_activations", False))
        card["bits"] = _one_or_list({s.bits for s in schemes})
        if w8a8 and any(s.kind == "nvfp4-w4a4" for s in schemes):
            card["group_size"] = _one_or_list({s.group for s in schemes})
            card["activations"] = "fp4 e2m1 dynamic per row and group of 16 (fp8 e4m3 scales, static global scale)"
        elif w8a8:
            per_tensor = getattr(fmt, "strategies", set()) == {"tensor"}
            card["group_size"] = None if per_tensor else -1
            card["activations"] = "; ".join(f"{k} {a}" for k in sorted(getattr(fmt, "kinds", ()))
                                           for a in sorted(getattr(fmt, "activations", ())))
        else:
            card["group_size"] = _one_or_list({s.group for s in schemes})
        return {"format": src.quantization.split(" (")[0], **card}
    if src.fp8_block is not None:
        return {"format": "fp8 block-wise (e4m3)", **card, "bits": 8,
                "group_size": list(src.fp8_block)}
    q = src.raw_config.get("quantization_config") or {}
    if q.get("quant_method") == "mxfp4":
        return {"format": "mxfp4", **card, "bits": 4, "group_size": 32}
    return None
