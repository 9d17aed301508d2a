"""The hybrid mixers' token recurrences: the causal depthwise conv over a sequence's conv window,
the gated delta rule (Gated DeltaNet: Qwen3.5, Qwen3-Next) and Mamba2's selective scan (SSD:
Nemotron-H, Granite 4.0), each reading and writing its sequences' states in the state pool
(``memory/state_pool.py``: ``[slots, ...]`` float32) by slot index.

A step's work arrives as an item table ``[N, 3]`` int32: per sequence ``(first flat row, tokens,
state slot)``. One program owns one sequence (and a head / channel block of it) and walks its
tokens in order, the state in registers between tokens, stored back once after the last: a decode
row is an item of one token, a prefill chunk or a verify run an item of many. Every token runs
the same code in the same program whatever the item's length or the step's other items, so a
sequence's bits do not depend on how its tokens were split into steps nor on its neighbours
(alone = batched = chunked, on one device). float32 throughout, as the reference keeps the state.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def conv_update_kernel(x_ptr, win_ptr, w_ptr, b_ptr, out_ptr, items_ptr, channels, x_stride, out_stride,
                       K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                       BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr):
    """One sequence's block of channels: ``out[t] = act(sum_j in[t - K + 1 + j] * w[:, j] (+ b))``,
    taps summed in order ``j = 0 .. K-1``, where inputs before the item's first row come from the
    window ``win[slot]`` ``[C, K - 1]`` (oldest first); then the window becomes the last ``K - 1``
    inputs. Every read of the window precedes its write (one program owns it)."""
    item = tl.program_id(0)
    first = tl.load(items_ptr + item * 3).to(tl.int64)
    n = tl.load(items_ptr + item * 3 + 1)
    slot = tl.load(items_ptr + item * 3 + 2).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    keep = cols < channels
    win = win_ptr + slot * channels * (K - 1) + cols * (K - 1)
    bias = tl.load(b_ptr + cols, mask=keep, other=0.0).to(tl.float32) if HAS_BIAS else 0.0
    # the window's new columns, read before anything is written: input n - (K - 1) + i
    taps = tl.arange(0, BLOCK_K)[None, :]
    src = n - (K - 1) + taps
    inside = keep[:, None] & (taps < K - 1)
    from_x = tl.load(x_ptr + (first + src) * x_stride + cols[:, None], mask=inside & (src >= 0), other=0.0)
    from_w = tl.load(win[:, None] + (n + taps), mask=inside & (src < 0), other=0.0)
    new_win = tl.where(src >= 0, from_x.to(tl.float32), from_w)
    for t in range(0, n):
        acc = tl.zeros([BLOCK_C], dtype=tl.float32)
        for j in tl.static_range(K):
            idx = t + j - (K - 1)  # the tap's input, relative to the item's first row
            xv = tl.load(x_ptr + (first + idx) * x_stride + cols, mask=keep & (idx >= 0), other=0.0).to(tl.float32)
            wv = tl.load(win + (K - 1 + idx), mask=keep & (idx < 0), other=0.0)
            tap = tl.where(idx >= 0, xv, wv) * tl.load(w_ptr + cols * K + j, mask=keep, other=0.0).to(tl.float32)
            acc = tap if j == 0 else acc + tap
        if HAS_BIAS:
            acc = acc + bias
        if SILU:
            acc = acc / (1.0 + tl.exp(-acc))
        tl.store(out_ptr + (first + t) * out_stride + cols, acc, mask=keep)
    tl.store(win[:, None] + taps, new_win, mask=inside)


@triton.jit
def gated_delta_kernel(q_ptr, k_ptr, v_ptr, decay_ptr, beta_ptr, state_ptr, out_ptr, items_ptr,
                       HV: tl.constexpr, HK: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                       BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    """One sequence, one value head, ``BLOCK_V`` of its value channels (each channel's column of
    ``S`` evolves alone). Per token, as ``layers/gated_delta.py``::

        S = S * decay;  S = S + k ⊗ (beta * (v - kᵀS));  o = qᵀS

    ``q``/``k`` ``[T, HK, DK]`` (normalized; value head ``h`` reads key head ``h // (HV / HK)``),
    ``v``/``out`` ``[T, HV, DV]``, ``decay``/``beta`` ``[T, HV]``, ``state`` ``[slots, HV, DK, DV]``."""
    item = tl.program_id(0)
    h = tl.program_id(1)
    first = tl.load(items_ptr + item * 3).to(tl.int64)
    n = tl.load(items_ptr + item * 3 + 1)
    slot = tl.load(items_ptr + item * 3 + 2).to(tl.int64)
    kh = h // (HV // HK)
    dk = tl.arange(0, BLOCK_K)
    dv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    kin, vin = dk < DK, dv < DV
    tile = kin[:, None] & vin[None, :]
    sp = state_ptr + (slot * HV + h) * DK * DV + dk[:, None] * DV + dv[None, :]
    s = tl.load(sp, mask=tile, other=0.0)
    for i in range(0, n):
        r = first + i
        kr = tl.load(k_ptr + (r * HK + kh) * DK + dk, mask=kin, other=0.0).to(tl.float32)
        qr = tl.load(q_ptr + (r * HK + kh) * DK + dk, mask=kin, other=0.0).to(tl.float32)
        vr = tl.load(v_ptr + (r * HV + h) * DV + dv, mask=vin, other=0.0).to(tl.float32)
        g = tl.load(decay_ptr + r * HV + h)
        b = tl.load(beta_ptr + r * HV + h)
        s = s * g
        kv = tl.sum(s * kr[:, None], axis=0)
        s = s + kr[:, None] * ((vr - kv) * b)[None, :]
        o = tl.sum(s * qr[:, None], axis=0)
        tl.store(out_ptr + (r * HV + h) * DV + dv, o, mask=vin)
    tl.store(sp, s, mask=tile)


@triton.jit
def ssd_scan_kernel(x_ptr, b_ptr, c_ptr, dt_ptr, decay_ptr, state_ptr, out_ptr, items_ptr, x_stride, bc_stride,
                    H: tl.constexpr, G: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
                    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """One sequence, one head, ``BLOCK_P`` of its channels. Per token, as ``layers/mamba2.py``::

        h = h * decay + (dt * B[g]) ⊗ x;  y = h · C[g]

    ``x`` ``[T, H * P]``, ``B``/``C`` ``[T, G * N]`` (rows strided), ``dt``/``decay`` ``[T, H]``,
    ``state`` ``[slots, H, P, N]``, ``out`` ``[T, H, P]`` (``+ D x`` is the caller's)."""
    item = tl.program_id(0)
    h = tl.program_id(1)
    first = tl.load(items_ptr + item * 3).to(tl.int64)
    n = tl.load(items_ptr + item * 3 + 1)
    slot = tl.load(items_ptr + item * 3 + 2).to(tl.int64)
    g = h // (H // G)
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    m = tl.arange(0, BLOCK_N)
    pin, nin = p < P, m < N
    tile = pin[:, None] & nin[None, :]
    sp = state_ptr + (slot * H + h) * P * N + p[:, None] * N + m[None, :]
    s = tl.load(sp, mask=tile, other=0.0)
    for i in range(0, n):
        r = first + i
        xr = tl.load(x_ptr + r * x_stride + h * P + p, mask=pin, other=0.0).to(tl.float32)
        br = tl.load(b_ptr + r * bc_stride + g * N + m, mask=nin, other=0.0).to(tl.float32)
        cr = tl.load(c_ptr + r * bc_stride + g * N + m, mask=nin, other=0.0).to(tl.float32)
        dt = tl.load(dt_ptr + r * H + h)
        a = tl.load(decay_ptr + r * H + h)
        s = s * a + (dt * br)[None, :] * xr[:, None]
        y = tl.sum(s * cr[None, :], axis=1)
        tl.store(out_ptr + (r * H + h) * P + p, y, mask=pin)
    tl.store(sp, s, mask=tile)


def item_table(items: list[tuple[int, int, int]], device: torch.device) -> torch.Tensor:
    """``(first row, tokens, slot)`` per sequence as the kernels' ``[N, 3]`` int32 table."""
    return torch.tensor(items, dtype=torch.int32, device=device).reshape(-1, 3)


def conv_update(x: torch.Tensor, window: torch.Tensor, items: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None, silu: bool = True) -> torch.Tensor:
    """The causal depthwise conv of rows ``x`` ``[T, C]`` (rows may be strided), each item
    continuing the window of its slot ``window[slot]`` ``[C, K - 1]`` (float32, updated in place);
    ``weight`` ``[C, K]``; then SiLU (``silu``). → ``[T, C]`` float32."""
    t, c = x.shape
    k = weight.shape[1]
    assert x.stride(1) == 1 and window.is_contiguous() and weight.is_contiguous() and window.dtype == torch.float32
    assert window.shape[1:] == (c, k - 1) and k >= 2
    out = torch.empty((t, c), dtype=torch.float32, device=x.device)
    block = min(256, triton.next_power_of_2(c))
    if items.shape[0]:
        conv_update_kernel[(items.shape[0], triton.cdiv(c, block))](
            x, window, weight, bias if bias is not None else weight, out, items, c, x.stride(0), c,
            K=k, HAS_BIAS=bias is not None, SILU=silu, BLOCK_C=block, BLOCK_K=triton.next_power_of_2(k - 1))
    return out


def value_block(dv: int) -> int:
    """Value channels per program (the state tile is ``[DK, BLOCK_V]`` float32 in registers)."""
    return min(32, triton.next_power_of_2(dv))


def gated_delta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor,
                state: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
    """The gated delta rule over every item's tokens: ``q``/``k`` ``[T, HK, DK]``, ``v``
    ``[T, HV, DV]``, ``decay`` (``exp(g)``) and ``beta`` ``[T, HV]``, all float32; ``state``
    ``[slots, HV, DK, DV]`` float32, updated in place. → ``[T, HV, DV]`` float32."""
    t, hk, dk = q.shape
    hv, dv = v.shape[1:]
    assert state.shape[1:] == (hv, dk, dv) and state.dtype == torch.float32 and state.is_contiguous()
    assert hv % hk == 0
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    decay, beta = decay.contiguous(), beta.contiguous()
    out = torch.empty((t, hv, dv), dtype=torch.float32, device=v.device)
    bv = value_block(dv)
    if items.shape[0]:
        gated_delta_kernel[(items.shape[0], hv, triton.cdiv(dv, bv))](
            q, k, v, decay, beta, state, out, items, HV=hv, HK=hk, DK=dk, DV=dv,
            BLOCK_K=triton.next_power_of_2(dk), BLOCK_V=bv)
    return out


def ssd_scan(x: torch.Tensor, b: torch.Tensor, c: torch.Tensor, dt: torch.Tensor, decay: torch.Tensor,
             state: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
    """Mamba2's recurrence over every item's tokens: ``x`` ``[T, H * P]``, ``b``/``c`` ``[T, G * N]``
    (rows may be strided, unit columns), ``dt`` and ``decay`` (``exp(dt * A)``) ``[T, H]``, float32;
    ``state`` ``[slots, H, P, N]`` float32, updated in place. → ``y`` ``[T, H, P]`` float32."""
    t = x.shape[0]
    _, h, p, n = state.shape
    g = b.shape[1] // n
    assert state.dtype == torch.float32 and state.is_contiguous() and h % g == 0 and x.shape[1] == h * p
    assert x.stride(1) == 1 and b.stride(1) == 1 and c.stride(1) == 1 and b.stride(0) == c.stride(0)
    dt, decay = dt.contiguous(), decay.contiguous()
    out = torch.empty((t, h, p), dtype=torch.float32, device=x.device)
    bp = min(32, triton.next_power_of_2(p))
    if items.shape[0]:
        ssd_scan_kernel[(items.shape[0], h, triton.cdiv(p, bp))](
            x, b, c, dt, decay, state, out, items, x.stride(0), b.stride(0), H=h, G=g, P=p, N=n,
            BLOCK_P=bp, BLOCK_N=triton.next_power_of_2(n))
    return out
