"""The Mamba2 mixer against Hugging Face's NemotronH Mamba2 mixer (float32), and its exactness:
a prefill split anywhere (state carried), prefill + decode steps, and any batch composition give
the same bits as one prefill alone."""

from __future__ import annotations

import pytest
import torch

from tripod.layers.backends.reference import ReferenceBackend
from tripod.layers.mamba2 import Mamba2Config, Mamba2Mixer, causal_conv, new_state
from tripod.layers.weights import WeightSource

transformers = pytest.importorskip("transformers")
from transformers import DynamicCache, NemotronHConfig  # noqa: E402
from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer  # noqa: E402

HIDDEN = 32


def _hf_config(chunk: int = 8) -> NemotronHConfig:
    return NemotronHConfig(
        vocab_size=64, hidden_size=HIDDEN, layers_block_type=["linear_attention"], num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=8, n_groups=2,
        conv_kernel=4, chunk_size=chunk, intermediate_size=48, layer_norm_epsilon=1e-5,
    )


@pytest.fixture(scope="module")
def pair() -> tuple[NemotronHMamba2Mixer, Mamba2Mixer]:
    """HF's mixer with random (non-default) SSM parameters, and tripod's with its weights."""
    torch.manual_seed(0)
    hf_cfg = _hf_config()
    hf = NemotronHMamba2Mixer(hf_cfg, layer_idx=0).eval()
    with torch.no_grad():
        hf.dt_bias.copy_(torch.randn(4) * 0.5 - 1.0)
        hf.A_log.copy_(torch.randn(4) * 0.5)
        hf.D.copy_(torch.randn(4))
        hf.norm.weight.copy_(1.0 + 0.1 * torch.randn(hf.norm.weight.shape))
        hf.conv1d.bias.copy_(0.1 * torch.randn(hf.conv1d.bias.shape))
    cfg = Mamba2Config(hidden_size=HIDDEN, num_heads=4, head_dim=8, state_size=8, n_groups=2, conv_kernel=4, eps=1e-5)
    ours = Mamba2Mixer(cfg, torch.float32)
    ours.load(WeightSource(hf.state_dict(), torch.float32, torch.device("cpu")), "")
    ours.prepare(ReferenceBackend())
    return hf, ours


def test_state_layout() -> None:
    cfg = Mamba2Config(hidden_size=HIDDEN, num_heads=4, head_dim=8, state_size=8, n_groups=2, conv_kernel=4, eps=1e-5)
    conv, ssm = new_state(cfg, 3)
    assert conv.shape == (3, 32 + 2 * 2 * 8, 3) and ssm.shape == (3, 4, 8, 8)
    assert conv.dtype == ssm.dtype == torch.float32
    assert cfg.state_bytes() == 4 * (64 * 3 + 4 * 8 * 8)
    with pytest.raises(ValueError, match="groups"):
        Mamba2Config(hidden_size=HIDDEN, num_heads=4, head_dim=8, state_size=8, n_groups=3, conv_kernel=4, eps=1e-5)


def test_prefill_and_decode_match_transformers(pair: tuple[NemotronHMamba2Mixer, Mamba2Mixer]) -> None:
    hf, ours = pair
    be = ReferenceBackend()
    torch.manual_seed(1)
    x = torch.randn(1, 21, HIDDEN)  # 21 tokens: HF's chunked scan runs 3 chunks of 8
    cache = DynamicCache(config=_hf_config())
    conv, ssm = new_state(ours.cfg, 1)
    with torch.no_grad():
        ref = hf(x, cache=cache)[0]
    got = ours(x[0], be, conv, ssm, [21])
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ssm, cache.get_recurrent_state(0), rtol=1e-5, atol=1e-5)
    # HF keeps the last K inputs of the conv; tripod the last K - 1 (all the next token needs).
    torch.testing.assert_close(conv, cache.get_conv_state(0)[:, :, 1:], rtol=0, atol=0)
    for _ in range(4):
        step = torch.randn(1, 1, HIDDEN)
        with torch.no_grad():
            ref = hf(step, cache=cache)[0]
        torch.testing.assert_close(ours(step[0], be, conv, ssm, [1]), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ssm, cache.get_recurrent_state(0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cuts", [(1,), (3, 4), (7, 2, 1, 1), (1,) * 19])
def test_split_prefill_is_bit_exact(pair: tuple[NemotronHMamba2Mixer, Mamba2Mixer], cuts: tuple[int, ...]) -> None:
    """The state carried between pieces of a prefill (of any lengths; 1 = a decode step) gives the
    same outputs and final state as one prefill, bit for bit."""
    _, ours = pair
    torch.manual_seed(2)
    zx = torch.randn(20, ours.cfg.proj_size)
    conv, ssm = new_state(ours.cfg, 1)
    whole = ours.mix(zx, conv, ssm, [20])
    conv2, ssm2 = new_state(ours.cfg, 1)
    pieces, row = [], 0
    for n in (*cuts, 20 - sum(cuts)):
        pieces.append(ours.mix(zx[row : row + n], conv2, ssm2, [n]))
        row += n
    assert torch.equal(torch.cat(pieces), whole)
    assert torch.equal(ssm2, ssm) and torch.equal(conv2, conv)


def test_batch_composition_is_bit_exact(pair: tuple[NemotronHMamba2Mixer, Mamba2Mixer]) -> None:
    """Decode rows and prefill chunks of several sequences in one call: each sequence's rows and
    state are those it gets alone."""
    _, ours = pair
    torch.manual_seed(3)
    lens = [1, 1, 6, 1, 9]
    zx = torch.randn(sum(lens), ours.cfg.proj_size)
    conv, ssm = new_state(ours.cfg, len(lens))
    conv.normal_()  # sequences already under way
    ssm.normal_()
    conv0, ssm0 = conv.clone(), ssm.clone()
    together = ours.mix(zx, conv, ssm, lens)
    row = 0
    for s, n in enumerate(lens):
        c, h = conv0[s : s + 1].clone(), ssm0[s : s + 1].clone()
        alone = ours.mix(zx[row : row + n], c, h, [n])
        assert torch.equal(alone, together[row : row + n])
        assert torch.equal(c, conv[s : s + 1]) and torch.equal(h, ssm[s : s + 1])
        row += n


def test_rows_and_states_must_agree(pair: tuple[NemotronHMamba2Mixer, Mamba2Mixer]) -> None:
    _, ours = pair
    conv, ssm = new_state(ours.cfg, 2)
    with pytest.raises(ValueError, match="rows"):
        ours.mix(torch.zeros(5, ours.cfg.proj_size), conv, ssm, [2, 2])


def test_whole_layer_on_kernel_linears_is_bit_exact(pair: tuple[NemotronHMamba2Mixer, Mamba2Mixer]) -> None:
    """The whole layer (projections on tripod's row-invariant CPU kernels): a prefill split into
    a chunk and decode steps, and a decode batched with other sequences, give one prefill's bits."""
    from tripod import kernels
    from tripod.layers.backends.cpu import CpuLinearBackend

    assert kernels.load(wait=True), f"the kernels should build on this machine: {kernels.unavailable_reason()}"
    level = kernels.best_level()
    assert level is not None
    be = CpuLinearBackend(kernels.ops(level), level, False, "test")
    _, ours = pair
    ours.prepare(be)
    torch.manual_seed(5)
    h = torch.randn(12, HIDDEN)
    conv, ssm = new_state(ours.cfg, 1)
    whole = ours(h, be, conv, ssm, [12])
    # the same sequence: 9 tokens of prefill, then 3 decode steps, each beside two other sequences
    c2, s2 = new_state(ours.cfg, 3)
    first = ours(h[:9], be, c2[:1], s2[:1], [9])
    assert torch.equal(first, whole[:9])
    for j in range(9, 12):
        rows = torch.cat((torch.randn(1, HIDDEN), h[j : j + 1], torch.randn(1, HIDDEN)))
        c3, s3 = torch.cat((c2[1:2], c2[:1], c2[2:])), torch.cat((s2[1:2], s2[:1], s2[2:]))
        out = ours(rows, be, c3, s3, [1, 1, 1])
        assert torch.equal(out[1], whole[j])
        c2 = torch.cat((c3[1:2], c3[:1], c3[2:]))
        s2 = torch.cat((s3[1:2], s3[:1], s3[2:]))
    assert torch.equal(s2[:1], ssm) and torch.equal(c2[:1], conv)


def test_short_conv_matches_transformers_and_splits_exactly() -> None:
    """LFM2's gated short convolution (same window machinery): HF's output and window; the
    tap-by-tap convolution split into pieces and batched with another sequence gives the same bits."""
    from transformers import Lfm2Config
    from transformers.models.lfm2.modeling_lfm2 import Lfm2ShortConv

    from tripod.layers.short_conv import ShortConv, new_conv_state

    torch.manual_seed(6)
    cfg = Lfm2Config(vocab_size=64, hidden_size=HIDDEN, num_hidden_layers=1, layer_types=["conv"], conv_L_cache=3,
                     conv_bias=True)
    hf = Lfm2ShortConv(cfg, 0).eval()
    ours = ShortConv(HIDDEN, 3, True, torch.float32)
    ours.load(WeightSource(hf.state_dict(), torch.float32, torch.device("cpu")), "")
    be = ReferenceBackend()
    ours.prepare(be)
    x = torch.randn(1, 10, HIDDEN)
    cache = DynamicCache(config=cfg)
    with torch.no_grad():
        ref = hf(x, cache=cache)[0]
    window = new_conv_state(HIDDEN, 3, 1)
    torch.testing.assert_close(ours(x[0], be, window, [10]), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(window, cache.get_conv_state(0)[:, :, 1:], rtol=0, atol=0)
    with pytest.raises(ValueError, match="rows"):
        ours(x[0], be, window, [4])
    # the convolution itself, split 3 + 1 + 6 with its window carried, beside a second sequence
    rows, w = torch.randn(10, HIDDEN), torch.randn(HIDDEN, 3)
    whole_win = new_conv_state(HIDDEN, 3, 1)
    whole = causal_conv(rows, whole_win, [10], w, None)
    win = new_conv_state(HIDDEN, 3, 2)
    parts = []
    for lo, hi in ((0, 3), (3, 4), (4, 10)):
        other = torch.randn(2, HIDDEN)
        parts.append(causal_conv(torch.cat((other, rows[lo:hi])), win, [2, hi - lo], w, None)[2:])
    assert torch.equal(torch.cat(parts), whole) and torch.equal(win[1:], whole_win)
