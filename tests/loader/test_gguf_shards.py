"""A rank of a model over several processes reads only its shard of a GGUF file: tensors are
dequantized one at a time as the layers load (``GGUFFile.lazy_weights``), a pipeline stage never
reads another stage's layers, and a tensor-parallel rank keeps a third of each projection."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tripod.engine.executor.group import weight_bytes
from tripod.layers.parallel import ParallelGroup, PipeStage
from tripod.loader import load_model
from tripod.loader.gguf_loader import GGUFFile

CPU = torch.device("cpu")


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    seen: list[str] = []
    real = GGUFFile.dequantized

    def counting(self: GGUFFile, t: Any, name: str, cfg: Any) -> torch.Tensor:
        seen.append(name)
        return real(self, t, name, cfg)

    monkeypatch.setattr(GGUFFile, "dequantized", counting)
    return seen


def test_a_pipeline_stage_reads_only_its_layers(gguf_path: Any, reads: list[str]) -> None:
    stage = PipeStage(1, 2)
    loaded = load_model(str(gguf_path), torch.float32, CPU, pp=stage)
    lo, hi = stage.layers(loaded.config.num_layers)
    layers = {int(n.split(".")[2]) for n in reads if n.startswith("model.layers.")}
    assert layers == set(range(lo, hi)), f"stage 1 of 2 read layers {sorted(layers)}"
    assert len(reads) == len(set(reads)), "a tensor was dequantized twice"


def test_a_tensor_parallel_rank_keeps_its_slice(gguf_path: Any, reads: list[str]) -> None:
    full = load_model(str(gguf_path), torch.float32, CPU)
    whole = weight_bytes(full.model)
    reads.clear()
    rank = load_model(str(gguf_path), torch.float32, CPU, tp=ParallelGroup(1, 3))  # 9 heads over 3 K/V heads
    assert weight_bytes(rank.model) < 0.45 * whole, "a rank holds more than its third (+ the replicated norms)"
    assert {n for n in reads if n.startswith("model.layers.")} == {
        n for n in GGUFFile(gguf_path).lazy_weights() if n.startswith("model.layers.")}
