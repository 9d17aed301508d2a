"""Kimi Delta Attention against Hugging Face's Kimi Linear KDA layer (float32), and its exactness:
a prefill split anywhere and any batch composition give one prefill's bits."""

from __future__ import annotations

import pytest
import torch

from tripod.layers.backends.reference import ReferenceBackend
from tripod.layers.kda import KdaConfig, KdaMixer, new_kda_state
from tripod.layers.weights import WeightSource

transformers = pytest.importorskip("transformers")
from transformers import DynamicCache, KimiLinearConfig  # noqa: E402
from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention  # noqa: E402

HIDDEN = 32


def _hf_config() -> KimiLinearConfig:
    return KimiLinearConfig(
        vocab_size=64, hidden_size=HIDDEN, num_hidden_layers=1, layer_types=["linear_attention"],
        pad_token_id=None, bos_token_id=None, eos_token_id=None,
        linear_attn_config={"head_dim": 8, "num_heads": 4, "short_conv_kernel_size": 4},
    )


@pytest.fixture(scope="module")
def pair() -> tuple[KimiLinearDeltaAttention, KdaMixer]:
    hf = KimiLinearDeltaAttention(_hf_config(), 0).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # every weight random: norms around 1, the rest around 0
        for name, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.3 * noise)
    ours = KdaMixer(KdaConfig(HIDDEN, 4, 8, 4, 1e-5), torch.float32)
    ours.load(WeightSource(hf.state_dict(), torch.float32, torch.device("cpu")), "")
    ours.prepare(ReferenceBackend())
    return hf, ours


def test_prefill_and_decode_match_transformers(pair: tuple[KimiLinearDeltaAttention, KdaMixer]) -> None:
    hf, ours = pair
    be = ReferenceBackend()
    torch.manual_seed(1)
    x = torch.randn(1, 21, HIDDEN)
    cache = DynamicCache(config=_hf_config())
    conv, rec = new_kda_state(ours.cfg, 1)
    with torch.no_grad():
        ref = hf(x, cache=cache)[0]
    torch.testing.assert_close(ours(x[0], be, conv, rec, [21]), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rec, cache.get_recurrent_state(0), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(conv, cache.get_conv_state(0)[:, :, 1:], rtol=0, atol=0)
    for _ in range(3):
        step = torch.randn(1, 1, HIDDEN)
        with torch.no_grad():
            ref = hf(step, cache=cache)[0]
        torch.testing.assert_close(ours(step[0], be, conv, rec, [1]), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rec, cache.get_recurrent_state(0), rtol=1e-5, atol=1e-5)
    assert ours.cfg.state_bytes() == 4 * (96 * 3 + 4 * 8 * 8)


def test_split_and_batched_are_bit_exact(pair: tuple[KimiLinearDeltaAttention, KdaMixer]) -> None:
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
    conv, rec = new_kda_state(ours.cfg, 1)
    whole = ours(h, be, conv, rec, [14])
    conv2, rec2 = new_kda_state(ours.cfg, 2)
    parts, row = [], 0
    for n in (7, 1, 1, 5):
        other = torch.randn(3, HIDDEN)
        parts.append(ours(torch.cat((other, h[row : row + n])), be, conv2, rec2, [3, n])[3:])
        row += n
    assert torch.equal(torch.cat(parts), whole)
    assert torch.equal(rec2[1:], rec) and torch.equal(conv2[1:], conv)
    with pytest.raises(ValueError, match="rows"):
        ours(h, be, conv2, rec2, [14])


def test_trace_keeps_the_state_after_every_row(pair: tuple[KimiLinearDeltaAttention, KdaMixer]) -> None:
    """Speculative verification's trace: for the sequences it names, the conv window and recurrent
    state before and after each row, equal bit for bit to the state after decoding those rows one
    at a time (the rollback target), beside another sequence that is not traced."""
    from tripod import kernels
    from tripod.layers.backends.cpu import CpuLinearBackend

    assert kernels.load(wait=True), f"the kernels should build on this machine: {kernels.unavailable_reason()}"
    level = kernels.best_level()
    assert level is not None
    be = CpuLinearBackend(kernels.ops(level), level, False, "test")  # (row-invariant linears)
    _, ours = pair
    ours.prepare(be)
    torch.manual_seed(3)
    prefix, rows = torch.randn(5, HIDDEN), torch.randn(4, HIDDEN)
    conv, rec = new_kda_state(ours.cfg, 2)
    ours(torch.cat((torch.randn(2, HIDDEN), prefix)), be, conv, rec, [2, 5])
    start = (conv[1:].clone(), rec[1:].clone())
    trace: dict[int, list[torch.Tensor]] = {1: []}
    ours(torch.cat((torch.randn(3, HIDDEN), rows)), be, conv, rec, [3, 4], trace=trace)
    win, states = trace[1]
    assert win.shape == (5, *conv.shape[1:]) and states.shape == (5, *rec.shape[1:])
    one_conv, one_rec = start[0].clone(), start[1].clone()
    assert torch.equal(win[0], one_conv[0]) and torch.equal(states[0], one_rec[0])
    for r in range(4):
        ours(rows[r : r + 1], be, one_conv, one_rec, [1])
        assert torch.equal(win[r + 1], one_conv[0]) and torch.equal(states[r + 1], one_rec[0]), f"after row {r}"
    assert torch.equal(states[4], rec[1]) and torch.equal(win[4], conv[1])
