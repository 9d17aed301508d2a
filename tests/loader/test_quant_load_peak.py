"""A quantized checkpoint is never held dequantized while it loads: the peak resident memory of
building an engine over a W4A16 folder with ``--weights stored`` stays well below the bf16 size of
its quantized projections (measured in a fresh process, ``tests/support/load_peak.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.int_quant import save_quantized
from tests.support.load_peak import load_peak
from tests.support.tiny_models import build_hf
from tripod import kernels

NO_KERNELS = kernels.unavailable_reason()


@pytest.mark.slow  # (~40 s: two engines built in fresh processes)
@pytest.mark.skipif(NO_KERNELS is not None, reason=f"tripod's CPU kernels: {NO_KERNELS}")
def test_w4a16_load_peak_stays_below_the_dense_size(tmp_path: Path, hf_tokenizer: Any) -> None:
    """The peak of loading a W4A16 folder (int4, group 32; 3 layers of 512 x 1536) minus the peak of
    loading a tiny one of the same format (what building any engine costs: the kernels, the
    tokenizer, the KV pool) is below 0.9 x the bf16 bytes of the quantized projections. Any dense copy
    of the model would reach at least 1.0 x (bf16) plus the codes (the loader used to reach 2 x: the
    whole model dequantized in float32); what remains is the stored codes and their packed copy while
    the stored form is built, 0.75 + 0.75 bytes a weight = 0.75 x."""
    big = build_hf("llama", seed=5, hidden_size=512, intermediate_size=1536, num_hidden_layers=3)
    n = sum(p.numel() for name, p in big.named_parameters() if name.startswith("model.layers.") and name.endswith("proj.weight"))
    dense_bf16 = 2 * n
    folder, _ = save_quantized(big, tmp_path / "big", hf_tokenizer, "ct", bits=4, group=32, sym=True)
    del big
    small, _ = save_quantized(build_hf("llama", seed=5), tmp_path / "small", hf_tokenizer, "ct", bits=4, group=32, sym=True)
    base = load_peak(small)
    got = load_peak(folder)
    assert got["weights"] == "stored" and base["weights"] == "stored"
    extra = (got["peak"] - got["before"]) - (base["peak"] - base["before"])
    assert extra < 0.9 * dense_bf16, (
        f"loading held {extra / 2**20:.1f} MiB for {dense_bf16 / 2**20:.1f} MiB of bf16 projections "
        f"(stored: {got['weight_bytes'] / 2**20:.1f} MiB)")
    assert got["weight_bytes"] < 0.45 * dense_bf16  # what stays: the packed codes, 0.75 bytes a weight
