"""``--weights auto`` (the default): what a model's weights run as on this machine.

A quantized GGUF runs **as stored** (``stored``: exactly the file's values on tripod's kernels, a
third to a half of bf16's bytes per token, with the run dtype's activations — bfloat16 under
``--dtype auto``, each bf16 activation x code product exact) where the kernels can: on the CPU,
in one process, with the run dtype left to ``auto``, and the file's dominant type one the kernels
execute (Q4_0, Q4_1, Q8_0, Q5_0, Q4_K, Q6_K). So does an AWQ / GPTQ / compressed-tensors folder whose
config has a scheme the kernels execute (int4 or int8 groups of a multiple of 32; ``loader/hf_quant.py``), and a W8A8
folder always (its activations are quantized as the checkpoint says; ``layers/w8a8.py``). Everything
else runs dequantized, which for a 16-bit (or
float32) checkpoint *is* its stored values. An explicit ``--dtype`` (``float32``: the reference
path, token-exact against transformers; ``bfloat16``) keeps the dequantized weights it names.

The choice is made once, before the engine is built, logged with its reason, and the resolved
mode (never ``auto``) is what the engine, ``/v1/models`` and the KV identity see.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from tripod import kernels
from tripod.config import EngineConfig, dtype_alias
from tripod.loader import open_source
from tripod.loader.gguf_loader import GGUFFile
from tripod.loader.hf_loader import HFFolder

log = logging.getLogger("tripod.loader")

EXECUTED_AS_STORED = frozenset({"Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q4_K", "Q6_K"})


def auto_weights(config: EngineConfig) -> tuple[str, str]:
    """(``"stored"`` or ``"dequantized"``, why) for ``--weights auto``."""
    w8a8 = _w8a8(config)
    if w8a8 is not None:  # activations quantized as the checkpoint says: only the stored form runs it
        return "stored", (f"{w8a8} (activations quantized as the checkpoint says; W8A8: int8 x int8 -> int32 "
                          "on tripod's CPU kernels (torch._int_mm off them and above 16 rows), FP8 as an exact float64 "
                          "emulation; NVFP4 W4A4: exact FP4 code products)")
    if config.device != "cpu":
        return "dequantized", f"the stored form runs on tripod's CPU kernels (device {config.device})"
    if config.kernels == "eager":
        return "dequantized", "--kernels eager runs the reference path"
    if config.kernels == "triton":
        return "dequantized", "the Triton kernels run dequantized weights (cuBLAS-style linears)"
    if dtype_alias(config.dtype) != "auto":
        return "dequantized", f"--dtype {config.dtype} names the weights' dtype"
    if config.world_size > 1:
        return "dequantized", "a model over several processes runs dequantized weights"
    why = kernels.unavailable_reason(config.kernel_level)
    if why is not None:
        return "dequantized", f"tripod's kernels cannot run here: {why}"
    try:
        _name, _path, src = open_source(config.model)
    except (ValueError, OSError) as e:
        return "dequantized", f"the model could not be opened ({e})"  # the load reports it again
    if isinstance(src, HFFolder) and src.int_format is not None:
        why = src.int_format.not_stored_reason()
        if why is not None:
            return "dequantized", f"{src.quantization}: {why}"
        hybrid = src.config().hybrid
        if hybrid is not None and hybrid.hf is not None:  # (engine/builder.check_hybrid says why)
            return "dequantized", f"{src.quantization}: a state-space hybrid's folder is not read as stored yet"
        return "stored", f"{src.quantization} executed as stored (codes x activations, scales per group)"
    if not isinstance(src, GGUFFile):
        return "dequantized", "a checkpoint folder: its 16-bit weights are its stored values"
    if src.quantization not in EXECUTED_AS_STORED:
        return "dequantized", f"{src.quantization} is not a type tripod's kernels execute as stored"
    return "stored", f"{src.quantization} GGUF executed as stored"


def resolve_weights(config: EngineConfig) -> EngineConfig:
    """``config`` with ``weights="auto"`` replaced by what it means here (unchanged otherwise)."""
    if config.weights != "auto":
        return config
    mode, why = auto_weights(config)
    log.info("--weights auto: %s (%s)", mode, why)
    return replace(config, weights=mode)


def _w8a8(config: EngineConfig) -> str | None:
    """The description of a W8A8 folder's format (None for anything else or what cannot be opened)."""
    try:
        _name, _path, src = open_source(config.model)
    except (ValueError, OSError):
        return None
    fmt = src.int_format if isinstance(src, HFFolder) else None
    return src.quantization if fmt is not None and fmt.quantizes_activations else None
