"""The hybrid mixers' CPU kernels (``tripod/kernels/csrc/recurrent.cpp``, through ``CpuBackend``):
the causal conv update, the gated delta rule and Mamba2's scan against the layers' torch code on
ragged items whose states sit at scattered pool slots (float32 rounding apart); a sequence's
tokens as one item, as one token per step, or cut into other chunks beside other sequences give
the same bits; and the per-row states a traced item keeps are the states those token steps leave."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tripod.kernels import reference
from tripod.layers.backends.cpu import CpuBackend
from tripod.layers.batch import StateRows
from tripod.layers.gated_delta import gated_delta_recurrence
from tripod.layers.mamba2 import causal_conv, silu_exact

TOL = 2e-5
ITEMS = [(0, 5, 3), (5, 1, 0), (6, 7, 2), (13, 1, 5)]  # (first row, tokens, slot): prefill, decode, ...
T = 14
SLOTS = 6


@pytest.fixture(scope="module")
def cpu(ops: Any) -> CpuBackend:
    from tripod import kernels

    return CpuBackend(ops, kernels.best_level() or "cpu")


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    err = (got - want).abs().max().item()
    scale = max(1.0, want.abs().max().item())
    assert err <= TOL * scale, f"{what}: max error {err:.3g} (scale {scale:.3g})"


def _steps(items: list[tuple[int, int, int]], cuts: list[int]) -> list[list[tuple[int, int, int]]]:
    """The same work as steps: step ``j`` runs the next ``cuts[j % len(cuts)]`` tokens of every
    sequence that has some left (1: decode rows)."""
    done = [0] * len(items)
    steps: list[list[tuple[int, int, int]]] = []
    while any(d < n for d, (_, n, _) in zip(done, items, strict=True)):
        size = cuts[len(steps) % len(cuts)]
        step = []
        for i, (first, n, slot) in enumerate(items):
            if done[i] < n:
                m = min(size, n - done[i])
                step.append((first + done[i], m, slot))
                done[i] += m
        steps.append(step)
    return steps


def _compact(step: list[tuple[int, int, int]]) -> tuple[list[int], list[tuple[int, int, int]]]:
    """A step's rows of the flat batch and its items over those rows only."""
    rows: list[int] = []
    items = []
    for first, n, slot in step:
        items.append((len(rows), n, slot))
        rows.extend(range(first, first + n))
    return rows, items


# ---------------------------------------------------------------------------- causal conv
def _conv_inputs(channels: int, kernel: int, seed: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, 2 * channels, generator=g).to(dtype)[:, :channels]  # strided rows, as the projection's slice
    w = torch.randn(channels, kernel, generator=g)
    b = torch.randn(channels, generator=g)
    win = torch.randn(SLOTS, channels, kernel - 1, generator=g)
    return x, w, b, win


def _conv_reference(x: torch.Tensor, win: torch.Tensor, items: list[tuple[int, int, int]], w: torch.Tensor,
                    b: torch.Tensor | None) -> torch.Tensor:
    """``layers/mamba2.causal_conv`` (the mixers' torch conv) + SiLU, one item at a time."""
    out = torch.empty(x.shape, dtype=torch.float32)
    for first, n, slot in items:
        one = win[slot : slot + 1]
        out[first : first + n] = causal_conv(x[first : first + n].float(), one, [n], w, b)
    return silu_exact(out)


@pytest.mark.parametrize("kernel,channels,bias,dtype", [(4, 40, True, torch.float32), (4, 300, False, torch.float32),
                                                        (2, 17, False, torch.float32), (4, 33, True, torch.bfloat16)])
def test_conv_update_against_the_reference(cpu: CpuBackend, kernel: int, channels: int, bias: bool,
                                           dtype: torch.dtype) -> None:
    x, w, b, win = _conv_inputs(channels, kernel, kernel * channels, dtype)
    want_win = win.clone()
    want = _conv_reference(x, want_win, ITEMS, w, b if bias else None)
    got = cpu.causal_conv(x, win, ITEMS, w, b if bias else None)
    _close(got, want, "conv output")
    _close(win, want_win, "conv window")
    untouched = [s for s in range(SLOTS) if s not in {s for _, _, s in ITEMS}]
    assert torch.equal(win[untouched], want_win[untouched])


@pytest.mark.parametrize("cuts", [[1], [2, 3], [4]])
def test_conv_whole_items_equal_any_split_bit_for_bit(cpu: CpuBackend, cuts: list[int]) -> None:
    x, w, b, win = _conv_inputs(300, 4, 3)
    whole_win = win.clone()
    whole = cpu.causal_conv(x, whole_win, ITEMS, w, b)
    parts = torch.empty_like(whole)
    for step in _steps(ITEMS, cuts):
        rows, items = _compact(step)
        parts[rows] = cpu.causal_conv(x[rows], win, items, w, b)
    assert torch.equal(whole, parts)
    assert torch.equal(whole_win, win)


# ---------------------------------------------------------------------------- gated delta rule
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
def test_gated_delta_against_the_reference(cpu: CpuBackend, hk: int, hv: int, dk: int, dv: int) -> None:
    q, k, v, decay, beta, state = _gdn_inputs(hk, hv, dk, dv, hk * 100 + hv * 10 + dk)
    rep = hv // hk
    want_state = state.clone()
    rows = StateRows(pool=None, items=ITEMS)  # type: ignore[arg-type]  (the reference reads the items only)
    want = gated_delta_recurrence(q.repeat_interleave(rep, 1), k.repeat_interleave(rep, 1), v, decay, beta,
                                  rows, want_state)
    got = cpu.gated_delta(q, k, v, decay, beta, state, ITEMS)
    _close(got, want, "gated delta output")
    _close(state, want_state, "gated delta state")
    untouched = [s for s in range(SLOTS) if s not in {s for _, _, s in ITEMS}]
    assert torch.equal(state[untouched], want_state[untouched])


@pytest.mark.parametrize("cuts", [[1], [3, 1, 2]])
def test_gated_delta_whole_items_equal_any_split_bit_for_bit(cpu: CpuBackend, cuts: list[int]) -> None:
    q, k, v, decay, beta, state = _gdn_inputs(2, 4, 32, 20, 7)
    whole_state = state.clone()
    whole = cpu.gated_delta(q, k, v, decay, beta, whole_state, ITEMS)
    parts = torch.empty_like(whole)
    for step in _steps(ITEMS, cuts):
        rows, items = _compact(step)
        parts[rows] = cpu.gated_delta(q[rows], k[rows], v[rows], decay[rows], beta[rows], state, items)
    assert torch.equal(whole, parts)
    assert torch.equal(whole_state, state)


def _kda_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor,
                   state: torch.Tensor, items: list[tuple[int, int, int]]) -> torch.Tensor:
    """``layers/kda.py``'s delta rule (a decay per key channel), one sequence and token at a time."""
    out = torch.empty_like(v)
    for first, n, slot in items:
        s = state[slot : slot + 1]
        for r in range(first, first + n):
            kr = k[r : r + 1, :, :, None]
            s = s * decay[r : r + 1, :, :, None]
            delta = (v[r : r + 1] - (s * kr).sum(-2)) * beta[r : r + 1, :, None]
            s = torch.addcmul(s, kr, delta[:, :, None, :])
            out[r : r + 1] = (s * q[r : r + 1, :, :, None]).sum(-2)
        state[slot : slot + 1] = s
    return out


def test_per_channel_decay_against_kda(cpu: CpuBackend) -> None:
    """KDA's delta rule (decay ``[T, H, DK]``) on the same kernel: against the torch loop, and
    whole items = one token per step, bit for bit."""
    q, k, v, _, beta, state = _gdn_inputs(3, 3, 20, 20, 21)
    decay = torch.exp(-torch.rand(T, 3, 20, generator=torch.Generator().manual_seed(22)))
    want_state = state.clone()
    want = _kda_reference(q, k, v, decay, beta, want_state, ITEMS)
    whole_state = state.clone()
    whole = cpu.gated_delta(q, k, v, decay, beta, whole_state, ITEMS)
    _close(whole, want, "KDA output")
    _close(whole_state, want_state, "KDA state")
    parts = torch.empty_like(whole)
    for step in _steps(ITEMS, [1]):
        rows, items = _compact(step)
        parts[rows] = cpu.gated_delta(q[rows], k[rows], v[rows], decay[rows], beta[rows], state, items)
    assert torch.equal(whole, parts) and torch.equal(whole_state, state)


def test_gated_delta_kept_rows_are_the_token_steps_states(cpu: CpuBackend) -> None:
    """A traced item's per-row states are those one-token steps leave; tracing changes no bits."""
    q, k, v, decay, beta, state = _gdn_inputs(2, 4, 16, 24, 9)
    plain_state = state.clone()
    plain = cpu.gated_delta(q, k, v, decay, beta, plain_state, ITEMS)
    rows = [0, -1, 6, -1]  # items 0 and 2 traced: 5 + 1 and 7 + 1 rows
    buf = torch.full((14, *state.shape[1:]), float("nan"))
    traced_state = state.clone()
    traced = cpu.gated_delta(q, k, v, decay, beta, traced_state, ITEMS, keep=(rows, buf))
    assert torch.equal(traced, plain) and torch.equal(traced_state, plain_state)
    for (first, n, slot), row in zip(ITEMS, rows, strict=True):
        if row < 0:
            continue
        s = state.clone()
        assert torch.equal(buf[row], s[slot])
        for i in range(n):
            r = [first + i]
            cpu.gated_delta(q[r], k[r], v[r], decay[r], beta[r], s, [(0, 1, slot)])
            assert torch.equal(buf[row + i + 1], s[slot]), f"slot {slot}: the state after row {i}"


def test_conv_kept_rows_are_the_token_steps_windows(cpu: CpuBackend) -> None:
    x, w, b, win = _conv_inputs(40, 4, 5)
    plain_win = win.clone()
    plain = cpu.causal_conv(x, plain_win, ITEMS, w, b)
    rows = [-1, 0, 2, -1]  # items 1 (1 token) and 2 (7 tokens)
    buf = torch.full((10, 40, 3), float("nan"))
    traced_win = win.clone()
    traced = cpu.causal_conv(x, traced_win, ITEMS, w, b, keep=(rows, buf))
    assert torch.equal(traced, plain) and torch.equal(traced_win, plain_win)
    for (first, n, slot), row in zip(ITEMS, rows, strict=True):
        if row < 0:
            continue
        s = win.clone()
        assert torch.equal(buf[row], s[slot])
        for i in range(n):
            cpu.causal_conv(x[first + i : first + i + 1], s, [(0, 1, slot)], w, b)
            assert torch.equal(buf[row + i + 1], s[slot]), f"slot {slot}: the window after row {i}"


# ---------------------------------------------------------------------------- Mamba2 scan
def _ssd_reference(x: torch.Tensor, b: torch.Tensor, c: torch.Tensor, dt: torch.Tensor, decay: torch.Tensor,
                   state: torch.Tensor, items: list[tuple[int, int, int]]) -> torch.Tensor:
    """``kernels/reference.py``'s Mamba2 recurrence (the build's self-test checks against it too),
    one sequence and token at a time."""
    return reference.ssd_scan(x, b, c, dt, decay, state, torch.tensor([(f, n, slot, -1) for f, n, slot in items]))


def _ssd_inputs(h: int, p: int, n: int, groups: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    xbc = torch.randn(T, h * p + 2 * groups * n + 5, generator=g)  # x | B | C | more: slices of one row
    x, b = xbc[:, : h * p], xbc[:, h * p : h * p + groups * n]
    c = xbc[:, h * p + groups * n : h * p + 2 * groups * n]
    dt = torch.rand(T, h, generator=g)
    decay = torch.exp(-dt * torch.rand(h, generator=g))
    state = torch.randn(SLOTS, h, p, n, generator=g)
    return x, b, c, dt, decay, state


@pytest.mark.parametrize("h,p,n,groups", [(4, 8, 8, 2), (3, 40, 16, 1)])
def test_ssd_scan_against_the_reference(cpu: CpuBackend, h: int, p: int, n: int, groups: int) -> None:
    x, b, c, dt, decay, state = _ssd_inputs(h, p, n, groups, h * p + n)
    want_state = state.clone()
    want = _ssd_reference(x, b, c, dt, decay, want_state, ITEMS)
    got = cpu.ssd_scan(x, b, c, dt, decay, state, ITEMS)
    _close(got, want, "ssd output")
    _close(state, want_state, "ssd state")


@pytest.mark.parametrize("cuts", [[1], [2, 5]])
def test_ssd_scan_whole_items_equal_any_split_bit_for_bit(cpu: CpuBackend, cuts: list[int]) -> None:
    x, b, c, dt, decay, state = _ssd_inputs(3, 40, 16, 1, 11)
    whole_state = state.clone()
    whole = cpu.ssd_scan(x, b, c, dt, decay, whole_state, ITEMS)
    parts = torch.empty_like(whole)
    for step in _steps(ITEMS, cuts):
        rows, items = _compact(step)
        parts[rows] = cpu.ssd_scan(x[rows], b[rows], c[rows], dt[rows], decay[rows], state, items)
    assert torch.equal(whole, parts)
    assert torch.equal(whole_state, state)


def test_ssd_scan_kept_rows_are_the_token_steps_states(cpu: CpuBackend) -> None:
    x, b, c, dt, decay, state = _ssd_inputs(4, 8, 8, 2, 13)
    rows = [0, -1, -1, 6]
    buf = torch.full((8, *state.shape[1:]), float("nan"))
    traced_state = state.clone()
    cpu.ssd_scan(x, b, c, dt, decay, traced_state, ITEMS, keep=(rows, buf))
    for (first, n, slot), row in zip(ITEMS, rows, strict=True):
        if row < 0:
            continue
        s = state.clone()
        assert torch.equal(buf[row], s[slot])
        for i in range(n):
            r = [first + i]
            cpu.ssd_scan(x[r], b[r], c[r], dt[r], decay[r], s, [(0, 1, slot)])
            assert torch.equal(buf[row + i + 1], s[slot]), f"slot {slot}: the state after row {i}"
        assert torch.equal(traced_state[slot], s[slot])


# ---------------------------------------------------------------------------- through the engine
def test_engine_runs_the_kernels_and_matches_the_torch_loops(ops: Any, tmp_path: Any) -> None:
    """A tiny Qwen3.5 on the optimized path: every Gated DeltaNet layer of every step calls the
    kernels, and the greedy tokens equal those of the same engine with its mixers on the torch
    loops (logprobs to float32 rounding)."""
    pytest.importorskip("transformers")
    from tests.models.test_hybrid_gdn import PARAMS, PROMPTS, build_qwen3_5
    from tripod import Engine

    build_qwen3_5().save_pretrained(str(tmp_path))
    eng = Engine(model=str(tmp_path), dtype="float32", kv_cache_tokens=512, chunk_size=16, max_batch_tokens=32,
                 max_running=4, kernels="optimized")
    backend = eng.runner.backend
    assert type(backend).recurrent_kernels
    calls = {"gated_delta": 0, "causal_conv": 0}
    for name in calls:
        real = getattr(backend, name)

        def counted(*a: Any, _real: Any = real, _name: str = name, **kw: Any) -> torch.Tensor:
            calls[_name] += 1
            return _real(*a, **kw)

        setattr(backend, name, counted)
    got = eng.generate(PROMPTS, PARAMS)
    assert calls["gated_delta"] > 0 and calls["gated_delta"] == calls["causal_conv"]
    for name in calls:
        delattr(backend, name)
    backend.recurrent_kernels = False  # the same engine, its mixers on the torch loops
    want = eng.generate(PROMPTS, PARAMS)
    del backend.recurrent_kernels
    eng.close()
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.token_ids == b.token_ids, f"prompt {i}: tokens differ from the torch loops'"
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert abs(x.logprob - y.logprob) <= 1e-4, f"prompt {i}: logprob {x.logprob} vs {y.logprob}"
