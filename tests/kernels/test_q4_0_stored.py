"""GGUF Q4_0 executed as stored (format ``q4_0``): exactly gguf's dequantized weights
(``d * (q - 8)``) with float32 summation error only, on every kernel level this CPU runs, for
ragged batches and output counts off the 16-output tiles; a row's bits never depend on its batch;
and a small model written as a Q4_0 GGUF runs as stored under ``--weights auto`` (bf16 activations;
alone = batched), and with float32 activations gives the greedy tokens of the same file dequantized
to float32."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from tripod import kernels
from tripod.kernels.build import supported_levels

Q4_0 = gguf.GGMLQuantizationType.Q4_0
ROWS = (1, 3, 4, 5, 16, 17, 64)  # the direct tiles (<= 4 rows) and the decoded ones, ragged
pytestmark = pytest.mark.skipif(kernels.unavailable_reason() is not None,
                                reason=f"tripod's CPU kernels are unavailable here: {kernels.unavailable_reason()}")


@pytest.fixture(scope="module")
def levels() -> dict[str, Any]:
    out = {}
    for lv in supported_levels():
        assert kernels.load(lv, wait=True), f"the {lv} kernels must build here: {kernels.unavailable_reason(lv)}"
        out[lv] = kernels.ops(lv)
    return out


def _q4_0(n: int, k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A weight quantized by gguf's own Q4_0 quantizer: (uint8 blocks [n, k / 32 * 18], float32
    [n, k] as gguf dequantizes them)."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05
    blocks = gguf.quants.quantize(w, Q4_0)
    return blocks, gguf.quants.dequantize(blocks, Q4_0).astype(np.float32).reshape(n, k)


@pytest.mark.parametrize("n,k", [(70, 96), (200, 576), (17, 64), (16, 32)])  # 70, 200, 17: partial tiles
def test_q4_0_equals_gguf_dequantized_on_every_level(levels: dict[str, Any], n: int, k: int) -> None:
    blocks, deq = _q4_0(n, k, seed=n + k)
    ref_w = torch.from_numpy(deq)
    g = torch.Generator().manual_seed(n)
    x = torch.randn(max(ROWS), k, generator=g)
    res = torch.randn(max(ROWS), n, generator=g)
    for lv, ops in levels.items():
        packed = ops.pack_linear(torch.from_numpy(blocks.copy()), "q4_0", n, k)
        for m in ROWS:
            y = ops.linear_packed(x[:m], packed, "q4_0", n, k)
            assert y.shape == (m, n) and y.dtype == torch.float32
            for ref in (x[:m].double() @ ref_w.double().T, (x[:m] @ ref_w.T).double()):
                rel = ((y.double() - ref).abs().max() / ref.abs().max()).item()
                assert rel < 2e-6, f"{lv}: {m} rows of {n}x{k}: relative error {rel:.2e}"
            fused = ops.linear_packed(x[:m], packed, "q4_0", n, k, res[:m])
            torch.testing.assert_close(fused, res[:m] + y, atol=1e-5, rtol=1e-2)
            yb = ops.linear_packed(x[:m].bfloat16(), packed, "q4_0", n, k)
            assert yb.dtype == torch.bfloat16


@pytest.mark.parametrize("n,k", [(70, 96), (200, 576)])
def test_a_q4_0_row_is_the_same_alone_and_in_any_batch(levels: dict[str, Any], n: int, k: int) -> None:
    blocks, _ = _q4_0(n, k, seed=7)
    g = torch.Generator().manual_seed(k)
    x = torch.randn(64, k, generator=g)
    res = torch.randn(64, n, generator=g)
    for lv, ops in levels.items():
        packed = ops.pack_linear(torch.from_numpy(blocks.copy()), "q4_0", n, k)
        full = ops.linear_packed(x, packed, "q4_0", n, k, res)
        alone = torch.cat([ops.linear_packed(x[i : i + 1], packed, "q4_0", n, k, res[i : i + 1]) for i in range(64)])
        assert torch.equal(alone, full), f"{lv}: a row alone differs from the row in a batch of 64"
        for start, m in ((0, 3), (5, 17), (10, 16), (40, 24)):
            part = ops.linear_packed(x[start : start + m], packed, "q4_0", n, k, res[start : start + m])
            assert torch.equal(part, full[start : start + m]), f"{lv}: rows {start}..{start + m} differ in a batch of 64"


def test_the_loader_keeps_q4_0_blocks_as_stored() -> None:
    from tripod.layers.linear import STORED_KINDS
    from tripod.loader.stored import convert, dequantize

    blocks, deq = _q4_0(48, 128, seed=1)
    kind, out = convert("Q4_0", blocks)
    assert kind == "Q4_0" and out is blocks and STORED_KINDS[kind] == "q4_0"
    assert np.array_equal(dequantize(kind, out, 128), deq)


# ---------------------------------------------------------------------------- a Q4_0 model
def _write_q4_0_model(path: Path, layers: int = 2) -> Path:
    """The embedded model's first ``layers`` layers, every 2-D weight requantized to Q4_0 by
    gguf's quantizer (norms stay float32), its metadata and vocabulary copied."""
    from tripod.loader.embedded import embedded_model_path

    reader = gguf.GGUFReader(embedded_model_path())
    arch = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(str(path), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value = layers if name == f"{arch}.block_count" else field.contents()
        sub = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, value, field.types[0], sub_type=sub)
    for t in reader.tensors:
        if t.name.startswith("blk.") and int(t.name.split(".")[1]) >= layers:
            continue
        if len(t.shape) == 2:
            w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
            writer.add_tensor(t.name, gguf.quants.quantize(w, Q4_0), raw_dtype=Q4_0)
        else:
            writer.add_tensor(t.name, np.array(t.data, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.slow
def test_a_q4_0_gguf_runs_as_stored_with_the_dequantized_greedy_tokens(
    tmp_path: Path, check_greedy: Any, greedy_from_tripod: Any
) -> None:
    from tripod import Engine, SamplingParams
    from tripod.config import EngineConfig
    from tripod.loader.gguf_loader import GGUFFile
    from tripod.loader.weights_mode import auto_weights

    path = _write_q4_0_model(tmp_path / "tiny.Q4_0.gguf")
    assert GGUFFile(path).quantization == "Q4_0"
    assert auto_weights(EngineConfig(model=str(path))) == ("stored", "Q4_0 GGUF executed as stored")
    prompts = [[1, 504, 3458, 282, 4649, 314], [1, 28, 94, 12, 4], list(range(100, 140))]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=5)
    auto = Engine(model=str(path), kv_cache_tokens=2048)  # --weights auto: stored blocks, bf16 activations
    assert auto.loaded.weights == "stored" and auto.runner.form == "stored" and auto.dtype_name == "bfloat16"
    batched = [o.token_ids for o in auto.generate(prompts, params)]
    assert [auto.generate([p], params)[0].token_ids for p in prompts] == batched, "the default: alone != batched"
    auto.assert_consistent()
    # The same blocks with float32 activations: the float32 dequantized model, token for token.
    stored = Engine(model=str(path), weights="stored", dtype="float32", kv_cache_tokens=2048)
    assert stored.loaded.weights == "stored" and stored.runner.form == "stored" and stored.loaded.model.has_stored_weights
    got = stored.generate(prompts, params)
    dense = Engine(model=str(path), weights="dequantized", dtype="float32", kv_cache_tokens=2048)
    assert dense.loaded.weights == "dequantized"
    want = dense.generate(prompts, params)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        same = check_greedy(a.token_ids, greedy_from_tripod(b), f"prompt {i} (Q4_0 as stored)")
        for j in range(same):
            assert abs(a.logprobs[j].logprob - b.logprobs[j].logprob) < 1e-3, (i, j)
    alone = [stored.generate([p], params)[0].token_ids for p in prompts]
    assert alone == [o.token_ids for o in got], "a request's tokens differ alone and batched"
