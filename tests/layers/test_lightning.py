"""MiniMax's lightning attention against transformers' ``MiniMaxLightningAttention`` (float32), and
its exactness: a prefill split anywhere and any batch composition give one prefill's bits."""

from __future__ import annotations

import pytest
import torch

from tripod.layers.backends.reference import ReferenceBackend
from tripod.layers.lightning import LightningAttention, LightningConfig
from tripod.layers.weights import WeightSource

transformers = pytest.importorskip("transformers")
from transformers import MiniMaxConfig  # noqa: E402
from transformers.models.minimax.modeling_minimax import MiniMaxCache, MiniMaxLightningAttention  # noqa: E402

HIDDEN, HEADS, DIM, LAYERS = 32, 4, 8, 4


@pytest.fixture(scope="module")
def pair() -> tuple[MiniMaxLightningAttention, LightningAttention]:
    cfg = MiniMaxConfig(vocab_size=64, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                        head_dim=DIM, block_size=8)
    hf = MiniMaxLightningAttention(cfg, 1).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.3 * noise)
    ours = LightningAttention(LightningConfig(HIDDEN, HEADS, DIM, 1, LAYERS, 1e-6), torch.float32)
    state = {k: v for k, v in hf.state_dict().items() if "decay" not in k}
    ours.load(WeightSource(state, torch.float32, torch.device("cpu")), "")
    ours.prepare(ReferenceBackend())
    return hf, ours


def test_prefill_and_decode_match_transformers(pair: tuple[MiniMaxLightningAttention, LightningAttention]) -> None:
    """transformers' block-wise prefill (blocks of 8 here: 21 tokens cross two block edges) and its
    decode recurrence, against tripod's token recurrence; the slopes from the formula equal the
    saved ones."""
    hf, ours = pair
    assert torch.equal(ours.cfg.slopes(), hf.slope_rate.reshape(-1))
    be = ReferenceBackend()
    torch.manual_seed(1)
    x = torch.randn(1, 21, HIDDEN)
    cache = MiniMaxCache()
    kv = torch.zeros(1, HEADS, DIM, DIM)
    with torch.no_grad():
        ref = hf(x, None, None, cache=cache)[0]
    torch.testing.assert_close(ours(x[0], be, kv, [21]), ref[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kv, cache.get_linear_cache(1), rtol=1e-5, atol=1e-5)
    for _ in range(3):
        step = torch.randn(1, 1, HIDDEN)
        with torch.no_grad():
            ref = hf(step, None, None, cache=cache)[0]
        torch.testing.assert_close(ours(step[0], be, kv, [1]), ref[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kv, cache.get_linear_cache(1), rtol=1e-5, atol=1e-5)


def test_split_and_batched_are_bit_exact(pair: tuple[MiniMaxLightningAttention, LightningAttention]) -> None:
    """On tripod's row-invariant CPU kernel linears: a prefill of 7 + 1 + 1 + 5 tokens, each piece
    beside another sequence's rows, equals one prefill of the 14 tokens, outputs and states."""
    from tripod import kernels
    from tripod.layers.backends.cpu import CpuLinearBackend

    assert kernels.load(wait=True), f"the kernels should build on this machine: {kernels.unavailable_reason()}"
    level = kernels.best_level()
    assert level is not None
    be = CpuLinearBackend(kernels.ops(level), level, False, "test")
    _, ours = pair
    ours.prepare(be)
    torch.manual_seed(2)
    h = torch.randn(14, HIDDEN)
    kv = torch.zeros(1, HEADS, DIM, DIM)
    whole = ours(h, be, kv, [14])
    kv2 = torch.zeros(2, HEADS, DIM, DIM)
    parts, row = [], 0
    for n in (7, 1, 1, 5):
        other = torch.randn(3, HIDDEN)
        parts.append(ours(torch.cat((other, h[row : row + n])), be, kv2, [3, n])[3:])
        row += n
    assert torch.equal(torch.cat(parts), whole)
    assert torch.equal(kv2[1:], kv)
    with pytest.raises(ValueError, match="rows"):
        ours(h, be, kv2, [14])


def test_trace_keeps_the_state_after_every_row(pair: tuple[MiniMaxLightningAttention, LightningAttention]) -> None:
    """Speculative verification's trace: for the sequences it names, the state before and after
    each row, equal bit for bit to the state after decoding those rows one at a time (the rollback
    target), beside another sequence that is not traced."""
    from tripod import kernels
    from tripod.layers.backends.cpu import CpuLinearBackend

    assert kernels.load(wait=True), f"the kernels should build on this machine: {kernels.unavailable_reason()}"
    level = kernels.best_level()
    assert level is not None
    be = CpuLinearBackend(kernels.ops(level), level, False, "test")  # (row-invariant linears)
    _, ours = pair
    ours.prepare(be)
    torch.manual_seed(3)
    rows = torch.randn(4, HIDDEN)
    kv = torch.zeros(2, HEADS, DIM, DIM)
    ours(torch.randn(7, HIDDEN), be, kv, [2, 5])
    one = kv[1:].clone()
    trace: dict[int, list[torch.Tensor]] = {1: []}
    ours(torch.cat((torch.randn(3, HIDDEN), rows)), be, kv, [3, 4], trace=trace)
    (states,) = trace[1]
    assert states.shape == (5, HEADS, DIM, DIM) and torch.equal(states[0], one[0])
    for r in range(4):
        ours(rows[r : r + 1], be, one, [1])
        assert torch.equal(states[r + 1], one[0]), f"after row {r}"
    assert torch.equal(states[4], kv[1])
