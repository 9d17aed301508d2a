"""tripod's GPU kernels, written in Triton: paged attention over the slot table (with split-KV for
long contexts), MLA's absorbed decode over the latent pool, fused RoPE + KV write, RMSNorm
(optionally with the residual add), SiLU·mul, and the hybrid mixers' token recurrences (causal conv,
gated delta rule, Mamba2 scan) over the state pool, and the stored quantized linears (W4A16,
W8A16 / NVFP4A16, the W8A8 INT8 code product). Other linears stay cuBLAS (``F.linear``).

The same sources run three ways:

- compiled for the GPU (a CUDA device, ``--device cuda``): what the ``triton`` backend serves on;
- in Triton's interpreter on CPU tensors (``TRITON_INTERPRET=1``): every kernel is tested against
  its reference there, and the whole engine runs on them (``--kernels triton --device cpu``);
- compiled ahead of time for sm_90 without a GPU (``python -m tripod.kernels.gpu compile``), which
  reports each kernel's registers, spills and shared memory.

This package imports triton only when a kernel is asked for (``ops()``), so importing it is free.
"""

from __future__ import annotations

import importlib.util
import os
from types import ModuleType

import torch


def interpreting() -> bool:
    """Whether Triton's interpreter runs the kernels (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "") == "1"


def unavailable_reason(device: torch.device) -> str | None:
    """Why the Triton kernels cannot run on ``device`` (None: they can)."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install 'tripod[gpu-test]', or the GPU image's triton)"
    if device.type == "cuda":
        if interpreting():
            return "TRITON_INTERPRET=1 runs the kernels on CPU tensors; unset it to run them on the GPU"
        return None
    if device.type == "cpu":
        if not interpreting():
            return "on the CPU the Triton kernels run only in Triton's interpreter: set TRITON_INTERPRET=1"
        return None
    return f"the Triton kernels run on CUDA devices (or the CPU in the interpreter), not {device}"


def ops() -> ModuleType:
    """The kernels' launchers (``tripod.kernels.gpu.launch``), importing triton on first use."""
    if interpreting():
        from tripod.kernels.gpu import interpret

        interpret.apply()
    from tripod.kernels.gpu import launch

    return launch


__all__ = ["interpreting", "ops", "unavailable_reason"]
