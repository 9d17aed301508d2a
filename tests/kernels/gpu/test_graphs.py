"""The decode graph runner on the CPU: buckets, padding and static buffers, with ``FakeGraph``
replaying the captured callable (only the capture itself needs a GPU)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.models import test_architectures as arch
from tests.models.test_architectures import PROMPTS
from tripod import Engine, SamplingParams
from tripod.engine.graphs import FakeGraph, bucket_for, buckets

tiny = arch.tiny  # the architectures suite's tiny checkpoints (a module-scoped fixture)


def test_buckets_cover_every_size_up_to_the_largest() -> None:
    assert buckets(256)[:9] == [1, 2, 4, 8, 16, 24, 32, 48, 64] and buckets(256)[-1] == 256
    assert buckets(20) == [1, 2, 4, 8, 16, 20] and buckets(1) == [1]
    sizes = buckets(100)
    for n in range(1, 101):
        b = bucket_for(n, sizes)
        assert b is not None and b >= n and all(s < n for s in sizes if s < b)
    assert bucket_for(101, sizes) is None


def test_fake_graph_replays_what_it_captured() -> None:
    buf = torch.zeros(3)
    g = FakeGraph()
    assert torch.equal(g.capture(lambda: buf * 2), torch.zeros(3))
    buf += 1  # a static buffer's new contents
    assert torch.equal(g.replay(), torch.full((3,), 2.0)) and g.replays == 1


def _engine(folder: Any, **kw: Any) -> Engine:
    return Engine(model=str(folder), kernels="triton", kv_cache_tokens=256, max_running=8, **kw)


def test_replays_equal_eager_bit_for_bit_and_padding_leaks_nothing(tiny: Any) -> None:
    """Four requests decoding, then three (one finished): the 3-row steps replay the 4-row
    bucket's graph with a padding row. Each replay's logits equal an eager forward of the same
    padded batch exactly; the tokens equal those with graphs off."""
    folder, _ = tiny("llama")
    eng = _engine(folder)
    graphs = eng.runner.graphs
    assert graphs is not None and graphs.fake
    seen: list[Any] = []
    original = graphs.run

    def run(batch: Any) -> torch.Tensor:
        out = original(batch)
        seen.append((batch, out))
        return out

    graphs.run = run  # type: ignore[method-assign]
    prompts = [p[:9] for p in PROMPTS]
    lens = [5, 5, 5, 2]
    outs = eng.generate(prompts, [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lens])
    sizes = [b.input_ids.numel() for b, _ in seen]
    assert 4 in sizes and 3 in sizes, sizes  # both through bucket 4
    assert set(graphs.static) == {4} and graphs.replays > 0
    for batch, got in seen:
        eager = eng.runner.model(graphs.padded(batch), eng.runner.pool)[: batch.input_ids.numel()]
        assert torch.equal(got, eager), f"a {batch.input_ids.numel()}-row replay differs from eager"
    plain = _engine(folder, cuda_graphs=False)
    assert plain.runner.graphs is None
    again = plain.generate(prompts, [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lens])
    assert [o.token_ids for o in outs] == [o.token_ids for o in again]
    eng.assert_consistent()


def test_steps_that_are_not_plain_decodes_run_eagerly(tiny: Any) -> None:
    folder, _ = tiny("llama")
    eng = _engine(folder, cuda_graph_max_bs=2)
    graphs = eng.runner.graphs
    assert graphs is not None and graphs.sizes == [1, 2]
    eng.generate([p[:9] for p in PROMPTS], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert graphs.eager > 0 and not graphs.static  # 4 rows: above the largest bucket
    with pytest.raises(ValueError, match="cuda_graph_max_bs"):
        _engine(folder, cuda_graph_max_bs=0)


def test_the_gpu_pool_is_what_the_utilization_leaves_after_the_weights() -> None:
    from tripod.memory.kv_pool import gpu_kv_bytes

    gib = 2**30
    # 141 GiB, 16 GiB of weights in use: 0.9 * 141 - 16 - 2 GiB of reserve.
    assert gpu_kv_bytes(125 * gib, 141 * gib, 0.9) == int(141 * gib * 0.9) - 16 * gib - 2 * gib
    with pytest.raises(ValueError, match="gpu-memory-utilization"):
        gpu_kv_bytes(10 * gib, 141 * gib, 0.5)  # 131 GiB in use already


def test_a_forward_a_graph_cannot_hold_falls_back_to_eager_for_good() -> None:
    from tripod.engine.graphs import DecodeGraphs
    from tripod.layers.backends.reference import REFERENCE
    from tripod.layers.batch import ForwardBatch, KernelMeta

    calls: list[int] = []

    def forward(b: ForwardBatch) -> torch.Tensor:
        calls.append(b.input_ids.numel())
        if len(calls) == 1:
            raise RuntimeError("operation not permitted when stream is capturing")
        return b.input_ids.float()[:, None].repeat(1, 5)

    table = torch.zeros(4, 8, dtype=torch.int32)
    graphs = DecodeGraphs(forward, REFERENCE, table, 1, torch.device("cpu"), 8, fake=True)
    ids = torch.tensor([3, 4, 5])
    meta = KernelMeta(table=table, rows=torch.zeros(3, dtype=torch.int32), lens=torch.ones(3, dtype=torch.int32),
                      blocks=torch.tensor([[0, 1], [1, 1], [2, 1]], dtype=torch.int32), block_m=1)
    batch = ForwardBatch(input_ids=ids, positions=ids, out_slots=ids, num_decode=0, decode_kv_idx=None,
                         decode_mask=None, backend=REFERENCE, kernel=meta)
    assert graphs.applies(batch)
    out = graphs.run(batch)  # the capture fails: this step runs eagerly, unpadded
    assert calls == [4, 3] and torch.equal(out[:, 0], ids.float())
    assert graphs.disabled and not graphs.applies(batch) and not graphs.static
