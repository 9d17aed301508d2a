"""``--weights auto`` (the default): a quantized GGUF runs as stored where the kernels can, and
everything else dequantized, with the reason; an explicit mode or dtype is kept."""

from __future__ import annotations

import pytest

from tripod import kernels
from tripod.config import EngineConfig
from tripod.loader.weights_mode import auto_weights, resolve_weights


def test_explicit_choices_stay_dequantized_with_the_reason() -> None:
    assert EngineConfig().weights == "auto"
    for cfg, why in ((EngineConfig(dtype="float32"), "--dtype float32"), (EngineConfig(dtype="bf16"), "--dtype bf16"),
                     (EngineConfig(kernels="eager"), "--kernels eager")):
        mode, reason = auto_weights(cfg)
        assert mode == "dequantized" and why in reason, reason
    assert resolve_weights(EngineConfig(weights="dequantized")).weights == "dequantized"
    assert resolve_weights(EngineConfig(weights="stored")).weights == "stored"


@pytest.mark.skipif(kernels.unavailable_reason() is not None, reason=f"kernels unavailable: {kernels.unavailable_reason()}")
def test_the_embedded_q4_1_gguf_runs_as_stored() -> None:
    cfg = resolve_weights(EngineConfig())
    assert cfg.weights == "stored" and auto_weights(EngineConfig())[1] == "Q4_1 GGUF executed as stored"
    assert cfg.compute_path(cfg.torch_dtype(cfg.torch_device())) == "optimized"
    # --dtype auto: bf16 activations (wherever the kernels run); --dtype float32 stays float32.
    import torch

    assert cfg.torch_dtype(cfg.torch_device()) == torch.bfloat16
    assert EngineConfig(weights="stored", dtype="float32").torch_dtype(cfg.torch_device()) == torch.float32
