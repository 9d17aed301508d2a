"""The hybrid mixers' Triton kernels (``tripod/kernels/gpu/recurrent.py``) in Triton's interpreter:
the causal conv update, the gated delta rule and Mamba2's scan against the layers' torch code on
ragged items whose states sit at scattered pool slots (float32 rounding apart), and a sequence's
tokens run as one item equal to the same tokens run one step at a time, bit for bit."""

from __future__ import annotations

import pytest
import torch

from tripod.kernels import gpu, reference
from tripod.layers.batch import StateRows
from tripod.layers.gated_delta import gated_delta_recurrence
from tripod.layers.mamba2 import causal_conv

gpu.ops()
from tripod.kernels.gpu import recurrent as R  # noqa: E402  (after the interpreter's shim)

TOL = 2e-5
ITEMS = [(0, 5, 3), (5, 1, 0), (6, 7, 2), (13, 1, 5)]  # (first row, tokens, slot): prefill, decode, ...
T = 14
SLOTS = 6


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    err = (got - want).abs().max().item()
    scale = max(1.0, want.abs().max().item())
    assert err <= TOL * scale, f"{what}: max error {err:.3g} (scale {scale:.3g})"


def _token_by_token(items: list[tuple[int, int, int]]) -> list[list[tuple[int, int, int]]]:
    """The same work as steps of one token per sequence (decode rows), in order."""
    steps = []
    for j in range(max(n for _, n, _ in items)):
        steps.append([(first + j, 1, slot) for first, n, slot in items if n > j])
    return steps


def _conv_reference(x: torch.Tensor, win: torch.Tensor, items: list[tuple[int, int, int]], w: torch.Tensor,
                    b: torch.Tensor | None) -> torch.Tensor:
    slots = [s for _, _, s in items]
    held = win[slots].clone()
    out = torch.empty_like(x)
    for i, (first, n, _) in enumerate(items):
        one = held[i : i + 1]
        out[first : first + n] = causal_conv(x[first : first + n], one, [n], w, b)
        held[i : i + 1] = one
    win[slots] = held
    return out / (1.0 + torch.exp(-out))


@pytest.mark.parametrize("kernel,channels,bias", [(4, 40, True), (4, 300, False), (2, 17, False)])
def test_conv_update_against_the_reference(kernel: int, channels: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(kernel * channels)
    x = torch.randn(T, 2 * channels, generator=g)[:, :channels]  # strided rows, as the projection's slice
    w = torch.randn(channels, kernel, generator=g)
    b = torch.randn(channels, generator=g) if bias else None
    win = torch.randn(SLOTS, channels, kernel - 1, generator=g)
    want_win = win.clone()
    want = _conv_reference(x, want_win, ITEMS, w, b)
    got = R.conv_update(x, win, R.item_table(ITEMS, x.device), w, b)
    _close(got, want, "conv output")
    _close(win, want_win, "conv window")
    untouched = [s for s in range(SLOTS) if s not in {s for _, _, s in ITEMS}]
    assert torch.equal(win[untouched], want_win[untouched])


def _gdn_inputs(hk: int, hv: int, dk: int, dv: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(T, hk, dk, generator=g), dim=-1) * dk**-0.5
    k = torch.nn.functional.normalize(torch.randn(T, hk, dk, generator=g), dim=-1)
    v = torch.randn(T, hv, dv, generator=g)
    decay = torch.exp(-torch.rand(T, hv, generator=g))
    beta = torch.rand(T, hv, generator=g)
    state = 0.5 * torch.randn(SLOTS, hv, dk, dv, generator=g)
    return q, k, v, decay, beta, state


@pytest.mark.parametrize("hk,hv,dk,dv", [(2, 2, 16, 16), (2, 4, 32, 48), (1, 3, 20, 8)])
def test_gated_delta_against_the_reference(hk: int, hv: int, dk: int, dv: int) -> None:
    q, k, v, decay, beta, state = _gdn_inputs(hk, hv, dk, dv, hk * 100 + hv * 10 + dk)
    rep = hv // hk
    want_state = state.clone()
    rows = StateRows(pool=None, items=ITEMS)  # type: ignore[arg-type]  (the reference reads the items only)
    want = gated_delta_recurrence(q.repeat_interleave(rep, 1), k.repeat_interleave(rep, 1), v, decay, beta,
                                  rows, want_state)
    got = R.gated_delta(q, k, v, decay, beta, state, R.item_table(ITEMS, q.device))
    _close(got, want, "gated delta output")
    _close(state, want_state, "gated delta state")


def test_gated_delta_whole_items_equal_token_steps_bit_for_bit() -> None:
    q, k, v, decay, beta, state = _gdn_inputs(2, 4, 32, 48, 7)
    whole_state = state.clone()
    whole = R.gated_delta(q, k, v, decay, beta, whole_state, R.item_table(ITEMS, q.device))
    steps = torch.empty_like(whole)
    for step in _token_by_token(ITEMS):
        rows = [first for first, _, _ in step]
        compact = [(i, 1, slot) for i, (_, _, slot) in enumerate(step)]
        steps[rows] = R.gated_delta(q[rows], k[rows], v[rows], decay[rows], beta[rows], state,
                                    R.item_table(compact, q.device))
    assert torch.equal(whole, steps)
    assert torch.equal(whole_state, state)


def test_conv_whole_items_equal_token_steps_bit_for_bit() -> None:
    g = torch.Generator().manual_seed(3)
    x, w, b = torch.randn(T, 24, generator=g), torch.randn(24, 4, generator=g), torch.randn(24, generator=g)
    win = torch.randn(SLOTS, 24, 3, generator=g)
    whole_win = win.clone()
    whole = R.conv_update(x, whole_win, R.item_table(ITEMS, x.device), w, b)
    steps = torch.empty_like(whole)
    for step in _token_by_token(ITEMS):
        rows = [first for first, _, _ in step]
        compact = [(i, 1, slot) for i, (_, _, slot) in enumerate(step)]
        steps[rows] = R.conv_update(x[rows], win, R.item_table(compact, x.device), w, b)
    assert torch.equal(whole, steps)
    assert torch.equal(whole_win, win)


def _ssd_reference(x: torch.Tensor, b: torch.Tensor, c: torch.Tensor, dt: torch.Tensor, decay: torch.Tensor,
                   state: torch.Tensor, items: list[tuple[int, int, int]]) -> torch.Tensor:
    """``kernels/reference.py``'s Mamba2 recurrence (the build's self-test checks against it too),
    one sequence and token at a time."""
    return reference.ssd_scan(x, b, c, dt, decay, state, torch.tensor([(f, n, slot, -1) for f, n, slot in items]))


def _ssd_inputs(h: int, p: int, n: int, groups: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, h * p, generator=g)
    bc = torch.randn(T, 2 * groups * n + 5, generator=g)  # B | C | more, as slices of one row
    b, c = bc[:, : groups * n], bc[:, groups * n : 2 * groups * n]
    dt = torch.rand(T, h, generator=g)
    decay = torch.exp(-dt * torch.rand(h, generator=g))
    state = torch.randn(SLOTS, h, p, n, generator=g)
    return x, b, c, dt, decay, state


@pytest.mark.parametrize("h,p,n,groups", [(4, 8, 8, 2), (3, 40, 16, 1)])
def test_ssd_scan_against_the_reference(h: int, p: int, n: int, groups: int) -> None:
    x, b, c, dt, decay, state = _ssd_inputs(h, p, n, groups, h * p + n)
    want_state = state.clone()
    want = _ssd_reference(x, b, c, dt, decay, want_state, ITEMS)
    got = R.ssd_scan(x, b, c, dt, decay, state, R.item_table(ITEMS, x.device))
    _close(got, want, "ssd output")
    _close(state, want_state, "ssd state")


def test_ssd_scan_whole_items_equal_token_steps_bit_for_bit() -> None:
    x, b, c, dt, decay, state = _ssd_inputs(4, 8, 8, 2, 11)
    whole_state = state.clone()
    whole = R.ssd_scan(x, b, c, dt, decay, whole_state, R.item_table(ITEMS, x.device))
    steps = torch.empty_like(whole)
    for step in _token_by_token(ITEMS):
        rows = [first for first, _, _ in step]
        compact = [(i, 1, slot) for i, (_, _, slot) in enumerate(step)]
        steps[rows] = R.ssd_scan(x[rows], b[rows], c[rows], dt[rows], decay[rows], state,
                                 R.item_table(compact, x.device))
    assert torch.equal(whole, steps)
    assert torch.equal(whole_state, state)
