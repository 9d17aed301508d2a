"""The prepared GPU check: kernels vs their references at real shapes, graph replay vs eager, the
embedded model's greedy tokens vs Hugging Face's, and throughput on random-weight Llama-3.1-8B
and DeepSeek-V2-Lite shapes against the run's own measured ceilings (copy bandwidth, bf16 GEMM).

    python benchmarks/gpu/device_check.py --out DIR            # on a CUDA GPU (device_check.sh)
    python benchmarks/gpu/device_check.py --out DIR --dry-run  # the same code on the CPU, Triton's
                                                               # interpreter, toy shapes (CI runs it)

Writes ``DIR/gpu_check.json`` and ``DIR/gpu_check.md`` after every section, so a run cut short
keeps what it measured. Each section's failure is recorded and the next one runs.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import sys
import time
import traceback
from pathlib import Path
from typing import Any

if "--dry-run" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import random_model as rm

from tripod import Engine, SamplingParams
from tripod.kernels import gpu
from tripod.layers.activation import activate
from tripod.layers.attention import sdpa
from tripod.layers.fp8 import (
    Fp8BlockLinear,
    Fp8ScaledLinear,
    Fp8Scales,
    dequantize_fp8,
    unsupported_reason,
)
from tripod.layers.norm import rms_norm
from tripod.layers.rotary import RotaryEmbedding, apply_rotary


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _timed(fn: Any, dev: torch.device, iters: int) -> float:
    fn()
    _sync(dev)
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync(dev)
    return (time.perf_counter() - t) / iters


def ceilings(dev: torch.device, dry: bool) -> dict[str, Any]:
    """Device copy bandwidth (read + write) and the dense GEMM rate, measured here."""
    n = (64 << 20) if dry else (4 << 30)
    x = torch.empty(n, dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    copy_s = _timed(lambda: y.copy_(x), dev, 3 if dry else 20)
    size, dt = (256, torch.float32) if dry else (8192, torch.bfloat16)
    a = torch.randn(size, size, device=dev, dtype=dt)
    b = torch.randn(size, size, device=dev, dtype=dt)
    mm_s = _timed(lambda: a @ b, dev, 3 if dry else 20)
    return {"copy_GBps": 2 * n / copy_s / 1e9, "gemm_TFLOPs": 2 * size**3 / mm_s / 1e12, "gemm_dtype": str(dt)}


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / max(1.0, float(want.float().abs().max())))


def kernels(dev: torch.device, dry: bool) -> list[dict[str, Any]]:
    """Every kernel against its reference op (float32 math on the same inputs)."""
    ops = gpu.ops()
    dt = torch.float32 if dry else torch.bfloat16
    tol = 1e-4 if dry else 2e-2
    g = torch.Generator(device=dev).manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=g, device=dev).to(dt)  # noqa: E731
    out: list[dict[str, Any]] = []

    def rec(name: str, e: float) -> None:
        out.append({"kernel": name, "rel_error": e, "tolerance": tol, "ok": e <= tol})

    hidden, inter = (64, 96) if dry else (4096, 14336)
    x, w = rnd(33, hidden), 1 + 0.1 * rnd(hidden)
    rec(f"rms_norm[{hidden}]", _err(ops.rms_norm(x, w, 1e-5)[0], rms_norm(x.float(), w.float(), 1e-5)))
    gu = rnd(33, 2 * inter)
    rec(f"silu_mul[{inter}]", _err(ops.silu_mul(gu, inter), activate(gu.float(), inter, "silu")))
    nh, nkv, d = (4, 2, 16) if dry else (32, 8, 128)
    rot = RotaryEmbedding(d, 500000.0, None, 4096, dev)
    qkv = rnd(17, (nh + 2 * nkv) * d)
    pos = torch.randint(0, 4096, (17,), device=dev)
    kv = torch.zeros(64, 2, nkv, d, device=dev, dtype=dt)
    want = apply_rotary(qkv.float().view(17, -1, d)[:, : nh + nkv], *rot.tables(pos, torch.float32))
    ops.rope_store_kv(qkv, pos, rot.cos, rot.sin, kv, torch.arange(17, device=dev), nh, nkv)
    rec(f"rope_store_kv[{nh}/{nkv}x{d}]", _err(qkv.view(17, -1, d)[:, : nh + nkv], want))
    out += _attention_checks(ops, dev, dt, tol, dry)
    out += _mask_and_fp8_checks(ops, dev, dry)
    out += _w4a16_checks(ops, dev, dry)
    out += _w8a8_checks(ops, dev, dry)
    out += _w8a16_checks(ops, dev, dry)
    out += _recurrent_checks(ops, dev, dry)
    return out


def _recurrent_checks(ops: Any, dev: torch.device, dry: bool) -> list[dict[str, Any]]:
    """The hybrid mixers' kernels (float32 states) at Qwen3.5's gated delta rule (16 key / 32 value
    heads, 128 x 128, conv over 8192 channels) and Nemotron-H's Mamba2 (128 heads x 64, state 128,
    8 groups) against the layers' torch recurrence on the same device; prefill items beside decode
    items at scattered slots; whole items = token steps bit for bit; a 64-sequence decode step's time
    against moving its states once at the copy rate."""
    from tripod.layers.batch import StateRows
    from tripod.layers.gated_delta import gated_delta_recurrence
    from tripod.layers.mamba2 import causal_conv

    tol = 1e-4
    g = torch.Generator(device=dev).manual_seed(2)
    rnd = lambda *s: torch.randn(*s, generator=g, device=dev)  # noqa: E731
    hk, hv, dk, dv, ch = (2, 4, 16, 16, 96) if dry else (16, 32, 128, 128, 8192)
    mh, mp, mn, mg = (4, 8, 8, 2) if dry else (128, 64, 128, 8)
    seqs = 8 if dry else 64
    items = [(0, 17, 5), (17, 1, 0), (18, 40 if not dry else 9, 7), (58 if not dry else 27, 1, 2)]
    t = items[-1][0] + 1
    res: list[dict[str, Any]] = []

    def rec(name: str, e: float, limit: float = tol, **more: Any) -> None:
        res.append({"kernel": name, "rel_error": e, "tolerance": limit, "ok": e <= limit, **more})

    def steps(fn: Any) -> None:  # the items' tokens one per sequence per call, as decode steps
        for j in range(max(n for _, n, _ in items)):
            step = [(first + j, slot) for first, n, slot in items if n > j]
            fn([r for r, _ in step], ops.item_table([(i, 1, s) for i, (_, s) in enumerate(step)], dev))

    # causal conv (+ SiLU), bf16 rows in as the projection gives them
    x = rnd(t, 2 * ch).to(torch.float32 if dry else torch.bfloat16)[:, :ch]
    w, win = rnd(ch, 4), rnd(seqs, ch, 3)
    want_win, want = win.clone(), torch.empty(t, ch, device=dev)
    for first, n, slot in items:
        one = want_win[slot : slot + 1]
        want[first : first + n] = causal_conv(x[first : first + n].float(), one, [n], w, None)
    want = want / (1.0 + torch.exp(-want))
    got = ops.conv_update(x, win, ops.item_table(items, dev), w, None)
    rec(f"conv_update[{ch}, kernel 4]", max(_err(got, want), _err(win, want_win)))
    # gated delta rule
    q = torch.nn.functional.normalize(rnd(t, hk, dk), dim=-1) * dk**-0.5
    k = torch.nn.functional.normalize(rnd(t, hk, dk), dim=-1)
    v, decay = rnd(t, hv, dv), torch.exp(-torch.rand(t, hv, generator=g, device=dev))
    beta = torch.rand(t, hv, generator=g, device=dev)
    state = 0.5 * rnd(seqs, hv, dk, dv)
    want_state, r = state.clone(), hv // hk
    want = gated_delta_recurrence(q.repeat_interleave(r, 1), k.repeat_interleave(r, 1), v, decay, beta,
                                  StateRows(None, items), want_state)  # type: ignore[arg-type]
    whole_state = state.clone()
    got = ops.gated_delta(q, k, v, decay, beta, whole_state, ops.item_table(items, dev))
    rec(f"gated_delta[{hv}/{hk} heads x {dk}x{dv}]", max(_err(got, want), _err(whole_state, want_state)))
    stepped = torch.empty_like(got)

    def gd(rows: list[int], table: torch.Tensor) -> None:
        stepped[rows] = ops.gated_delta(q[rows], k[rows], v[rows], decay[rows], beta[rows], state, table)

    steps(gd)
    same = torch.equal(stepped, got) and torch.equal(state, whole_state)
    rec("gated_delta whole items = token steps", 0.0 if same else 1.0, 0.0)
    # Mamba2 scan
    xm, bc = rnd(t, mh * mp), rnd(t, 2 * mg * mn)
    bm, cm = bc[:, : mg * mn], bc[:, mg * mn :]
    dtm = torch.rand(t, mh, generator=g, device=dev)
    am = torch.exp(-dtm * torch.rand(mh, generator=g, device=dev))
    ssm = rnd(seqs, mh, mp, mn)
    want_ssm, rep = ssm.clone(), mh // mg
    want = torch.empty(t, mh, mp, device=dev)
    bs = bm.view(t, mg, 1, mn).expand(t, mg, rep, mn).reshape(t, mh, mn)
    cs = cm.view(t, mg, 1, mn).expand(t, mg, rep, mn).reshape(t, mh, mn)
    for first, n, slot in items:
        h = want_ssm[slot]
        for i in range(first, first + n):
            h = h * am[i][:, None, None] + (dtm[i][:, None] * bs[i])[:, None, :] * xm[i].view(mh, mp)[:, :, None]
            want[i] = (h * cs[i][:, None, :]).sum(-1)
        want_ssm[slot] = h
    got = ops.ssd_scan(xm, bm, cm, dtm, am, ssm, ops.item_table(items, dev))
    rec(f"ssd_scan[{mh}x{mp}, state {mn}, {mg} groups]", max(_err(got, want), _err(ssm, want_ssm)))
    # one decode step of every sequence: its states read and written once
    decode = ops.item_table([(i, 1, i) for i in range(seqs)], dev)
    qd, kd, vd = q[:1].expand(seqs, hk, dk), k[:1].expand(seqs, hk, dk), v[:1].expand(seqs, hv, dv)
    dd, bd = decay[:1].expand(seqs, hv), beta[:1].expand(seqs, hv)
    ms = 1e3 * _timed(lambda: ops.gated_delta(qd, kd, vd, dd, bd, state, decode), dev, 2 if dry else 50)
    moved = 2 * state.numel() * 4
    rec(f"gated_delta decode step[{seqs} sequences]", 0.0, 0.0, ms=ms, state_gb_per_s=moved / ms / 1e6)
    return res


def _w4a16_checks(ops: Any, dev: torch.device, dry: bool) -> list[dict[str, Any]]:
    """The W4A16 linear (group 128, zero points) against the float64 dequantized product at M = 1 and
    64, a row alone = in a batch bit for bit, and (on a GPU) its time at M = 1 and 16 beside bf16 F.linear."""
    n, k, group = (96, 256, 128) if dry else (14336, 4096, 128)
    dt = torch.float32 if dry else torch.bfloat16
    g = torch.Generator().manual_seed(2)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scales = (torch.rand(n, k // group, generator=g) * 0.002 + 1e-4).to(torch.bfloat16).float()
    zeros = torch.randint(0, 16, (n, k // group), generator=g, dtype=torch.int32)
    g_idx = torch.arange(k) // group
    packed = ops.pack_w4(codes, scales, zeros, g_idx).to(dev)
    w64 = ((codes.double() - zeros.double()[:, g_idx]) * scales.double()[:, g_idx])
    out: list[dict[str, Any]] = []
    x = torch.randn(64, k, generator=g).to(dt)
    xd = x.to(dev)
    batched = ops.w4a16_linear(xd, packed)
    tol = 1e-4 if dry else 1e-2  # bf16 output rounding
    for m in (1, 64):
        e = _err(batched[:m].cpu().double(), x[:m].double() @ w64.T)
        row: dict[str, Any] = {"kernel": f"w4a16[{n}x{k}, group {group}, M={m}]", "rel_error": e, "tolerance": tol,
                               "ok": e <= tol}
        if not dry:
            dense = w64.to(torch.bfloat16).to(dev)
            for mm in (1, 16):
                row[f"ms_w4a16_M{mm}"] = _timed(lambda mm=mm: ops.w4a16_linear(xd[:mm], packed), dev, 20) * 1e3
                row[f"ms_bf16_dense_M{mm}"] = _timed(lambda mm=mm, d=dense: torch.nn.functional.linear(xd[:mm], d), dev,
                                                     20) * 1e3
        out.append(row)
    same = all(torch.equal(ops.w4a16_linear(xd[r:r + 1], packed), batched[r:r + 1]) for r in (0, 17, 63))
    out.append({"kernel": "w4a16 alone = batched", "rel_error": 0.0 if same else 1.0, "tolerance": 0.0, "ok": same})
    return out


def _w8a8_checks(ops: Any, dev: torch.device, dry: bool) -> list[dict[str, Any]]:
    """The W8A8 INT8 code product (int8 x int8 -> int32) against the int64 product on the CPU (exact:
    the tolerance is 0) at M = 1 and 64, the linear built on it against the CPU path's ``W8A8Linear``
    (bits equal is recorded; the float64 epilogue's rounding to bf16 is CUDA's there), a row alone =
    in a batch, and (on a GPU) times at M = 1 and 16 beside ``torch._int_mm`` and bf16 F.linear."""
    from tripod.layers.backends.triton import TritonW8A8Linear
    from tripod.layers.w8a8 import W8A8Linear

    n, k = (96, 256) if dry else (14336, 4096)
    dt = torch.float32 if dry else torch.bfloat16
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    scales = torch.rand(n, generator=g) * 1e-3 + 1e-4
    q = torch.randint(-128, 128, (64, k), generator=g, dtype=torch.int8)
    codes_d, qd = codes.to(dev), q.to(dev)
    acc = ops.int8_product(qd, codes_d)
    want = q.long() @ codes.long().t()
    out: list[dict[str, Any]] = []
    dense = (codes.float() * scales[:, None]).to(torch.bfloat16).to(dev)
    xb = torch.randn(16, k, generator=g).to(torch.bfloat16).to(dev)
    for m in (1, 64):
        same = torch.equal(acc[:m].cpu().long(), want[:m])
        row: dict[str, Any] = {"kernel": f"w8a8_int8[{n}x{k}, M={m}]", "rel_error": 0.0 if same else 1.0,
                               "tolerance": 0.0, "ok": same}
        if not dry:
            for mm in (1, 16):
                row[f"ms_w8a8_int8_M{mm}"] = _timed(lambda mm=mm: ops.int8_product(qd[:mm], codes_d), dev, 20) * 1e3
                try:  # (torch._int_mm wants M > 16 on some builds)
                    row[f"ms_int_mm_M{mm}"] = _timed(lambda mm=mm: torch._int_mm(qd[:max(mm, 17)], codes_d.t()), dev,
                                                     20) * 1e3
                except RuntimeError as e:
                    row[f"int_mm_M{mm}"] = str(e)[:200]
                row[f"ms_bf16_dense_M{mm}"] = _timed(lambda mm=mm, d=dense: torch.nn.functional.linear(xb[:mm], d), dev,
                                                     20) * 1e3
        out.append(row)
    x = torch.randn(33, k, generator=g).to(dt)
    tri = TritonW8A8Linear(ops, codes_d, scales.to(dev), None, None)
    y = tri(x.to(dev))
    cpu_bits = torch.equal(y.cpu(), W8A8Linear(codes, scales, "int8", None)(x))
    same = all(torch.equal(tri(x[r:r + 1].to(dev)), y[r:r + 1]) for r in (0, 16, 32))
    out.append({"kernel": "w8a8_int8 linear alone = batched", "rel_error": 0.0 if same else 1.0, "tolerance": 0.0,
                "ok": same, "cpu_path_bits_equal": cpu_bits})
    return out


def _w8a16_checks(ops: Any, dev: torch.device, dry: bool) -> list[dict[str, Any]]:
    """The W8A16 linear (symmetric 8-bit codes, group 128; and NVFP4A16's group 16) from the stored
    Q6_K form against the float64 dequantized product at M = 1 and 64, a row alone = in a batch, and
    (on a GPU) its time at M = 1 and 16."""
    from tripod.loader.hf_quant import GroupQuantized
    from tripod.loader.stored import group_blocks

    n, k = (96, 256) if dry else (14336, 4096)
    dt = torch.float32 if dry else torch.bfloat16
    g = torch.Generator().manual_seed(4)
    out: list[dict[str, Any]] = []
    for group in (128, 16):
        codes = torch.randint(0, 256, (n, k), generator=g, dtype=torch.uint8)
        scales = (torch.rand(n, k // group, generator=g) * 1e-4 + 1e-5).to(torch.bfloat16).float()
        g_idx = torch.arange(k) // group
        stored = group_blocks(GroupQuantized(codes, scales, torch.full(scales.shape, 128, dtype=torch.int32), g_idx, 8))
        assert stored is not None
        packed = ops.from_q8_blocks(stored[1], n, k, stored[2]).to(dev)
        w64 = (codes.double() - 128) * scales.double()[:, g_idx]
        x = torch.randn(64, k, generator=g).to(dt)
        xd = x.to(dev)
        batched = ops.w8a16_linear(xd, packed)
        tol = 1e-4 if dry else 1e-2  # bf16 output rounding
        for m in (1, 64):
            e = _err(batched[:m].cpu().double(), x[:m].double() @ w64.T)
            row: dict[str, Any] = {"kernel": f"w8a16[{n}x{k}, group {group}, M={m}]", "rel_error": e,
                                   "tolerance": tol, "ok": e <= tol}
            if not dry and m == 1:
                for mm in (1, 16):
                    row[f"ms_w8a16_M{mm}"] = _timed(lambda mm=mm, p=packed, xx=xd: ops.w8a16_linear(xx[:mm], p), dev,
                                                    20) * 1e3
            out.append(row)
        same = all(torch.equal(ops.w8a16_linear(xd[r:r + 1], packed), batched[r:r + 1]) for r in (0, 17, 63))
        out.append({"kernel": f"w8a16 group {group} alone = batched", "rel_error": 0.0 if same else 1.0,
                    "tolerance": 0.0, "ok": same})
    return out


def _mask_and_fp8_checks(ops: Any, dev: torch.device, dry: bool) -> list[dict[str, Any]]:
    """The grammar bitmask kernel (exact), and block-wise FP8 through torch._scaled_mm (w8a8)
    against the dequantized w8a16 product, with both timed at a decode batch on a GPU."""
    vocab = 2500 if dry else 128256
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(8, vocab, generator=g)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, (vocab + 31) // 32), generator=g, dtype=torch.int64).to(torch.int32)
    want = logits.clone()
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab].astype(bool)
    for j, r in enumerate([5, 0, 2]):
        want[r][torch.from_numpy(~bits[j])] = float("-inf")
    got = logits.to(dev)
    ops.apply_bitmask(got, bitmask.to(dev), torch.tensor([5, 0, 2], device=dev), vocab)
    same = torch.equal(got.cpu(), want)
    out: list[dict[str, Any]] = [{"kernel": f"apply_bitmask[{vocab}]", "rel_error": 0.0 if same else 1.0,
                                  "tolerance": 0.0, "ok": same}]
    n, k = (256, 512) if dry else (14336, 4096)
    w = (torch.randn(n, k, device=dev) * 0.05)
    scale = torch.full((n // 128, k // 128), 0.0005, device=dev)
    wq = (w / 0.0005).clamp(-448, 448).to(torch.float8_e4m3fn)
    sc = Fp8Scales(scale, (128, 128))
    why = unsupported_reason(wq, sc, force=dry)
    x = torch.randn(64, k, device=dev).to(torch.bfloat16)
    ref = Fp8BlockLinear(wq, sc, None)(x.float())
    row: dict[str, Any] = {"kernel": f"fp8 scaled_mm[{n}x{k}, 128x128 blocks]", "tolerance": 0.06}
    if why is not None:
        row.update(rel_error=None, ok=False, reason=why)
    else:
        lin = Fp8ScaledLinear(wq, sc, None)
        e = _err(lin(x), ref)
        row.update(rel_error=e, ok=e <= 0.06)
        if not dry:
            dense = dequantize_fp8(wq, sc, torch.bfloat16)
            row["ms_fp8_w8a8"] = _timed(lambda: lin(x), dev, 20) * 1e3
            row["ms_bf16_dense"] = _timed(lambda: torch.nn.functional.linear(x, dense), dev, 20) * 1e3
    out.append(row)
    return out


def _attention_checks(ops: Any, dev: torch.device, dt: torch.dtype, tol: float, dry: bool) -> list[dict[str, Any]]:
    res = []
    shapes = [(4, 2, 16), (8, 1, 64)] if dry else [(32, 8, 128), (16, 16, 64), (16, 2, 256)]
    width = 96 if dry else 2048
    g = torch.Generator(device=dev).manual_seed(1)
    for nh, nkv, d in shapes:
        table = torch.randperm(4 * width, generator=g, device=dev).view(4, width).to(torch.int32)
        kv = torch.randn(4 * width, 2, nkv, d, generator=g, device=dev).to(dt)
        items = [(0, width - 7, 1), (1, width // 3, 9), (2, 0, 1), (3, width // 2, 3)]
        rows, lens, starts, counts = [], [], [], []
        for r, p0, n in items:
            starts.append(len(rows))
            counts.append(n)
            rows += [r] * n
            lens += list(range(p0 + 1, p0 + n + 1))
        q = torch.randn(len(rows), nh, d, generator=g, device=dev).to(dt)
        for window, cap in ((None, None), (width // 4, 30.0)):
            want = torch.zeros(q.shape, device=dev)
            for t, (r, n) in enumerate(zip(rows, lens, strict=True)):
                lo = max(0, n - window) if window else 0
                sl = table[r, lo:n].long()
                k, v = kv[sl, 0].float().transpose(0, 1)[None], kv[sl, 1].float().transpose(0, 1)[None]
                want[t] = sdpa(q[t].float()[None, :, None], k, v, None, d**-0.5, cap)[0, :, 0]
            bm, _ = ops.tile(nh // nkv, True)
            blocks = torch.tensor(ops.query_blocks(starts, counts, bm), dtype=torch.int32, device=dev).view(-1, 2)
            keys = 32 if dry else 256
            got = ops.paged_attention(q, kv, table, torch.tensor(rows, dtype=torch.int32, device=dev),
                                      torch.tensor(lens, dtype=torch.int32, device=dev), blocks, bm, d**-0.5,
                                      split_keys=keys, splits=-(-width // keys), window=window, softcap=cap)
            e = _err(got, want)
            res.append({"kernel": f"paged_attention[{nh}/{nkv}x{d} window={window} softcap={cap}]", "rel_error": e,
                        "tolerance": tol, "ok": e <= tol})
    h, r, p = (4, 16, 16) if dry else (128, 512, 64)
    lat = (0.5 * torch.randn(4 * width, r + p, generator=g, device=dev)).to(dt)
    idx = torch.stack([torch.randperm(4 * width, generator=g, device=dev)[:width] for _ in range(3)])
    lens_l = [1, width // 2, width]
    qm = (0.1 * torch.randn(3, h, r + p, generator=g, device=dev)).to(dt)
    want = torch.zeros(3, h, r, device=dev)
    for b, n in enumerate(lens_l):
        keys_ = lat[idx[b, :n]].float()[None, None]
        want[b] = sdpa(qm[b].float()[None, :, None], keys_, keys_[..., :r], None, (r + p) ** -0.5)[0, :, 0]
    keys = 32 if dry else 256
    got = ops.mla_decode(qm, lat, idx, torch.tensor(lens_l, dtype=torch.int32, device=dev), r, (r + p) ** -0.5,
                         split_keys=keys, splits=-(-width // keys))
    e = _err(got, want)
    res.append({"kernel": f"mla_decode[{h}x({r}+{p})]", "rel_error": e, "tolerance": tol, "ok": e <= tol})
    return res


def graphs(dev: torch.device, dry: bool) -> dict[str, Any]:
    """Decode graphs: each replay's logits == an eager forward of the same padded batch, bit for
    bit; tokens with graphs == without; a request alone == in a batch."""
    shape = rm.TINY_LLAMA if dry else {**rm.LLAMA_8B, "num_hidden_layers": 4}
    dt = torch.float32 if dry else torch.bfloat16
    loaded = rm.random_model(shape, dt, dev, seed=3)
    kv = 256 if dry else 4096  # (the interpreter: one KV split)
    eng = Engine(loaded=loaded, kernels="triton", device=str(dev), kv_cache_tokens=kv, max_running=16)
    g = eng.runner.graphs
    assert g is not None, "no graph runner"
    seen: list[Any] = []
    run = g.run
    g.run = lambda b: seen.append((b, run(b))) or seen[-1][1]  # type: ignore[method-assign]
    prompts = [[(7 * i + j) % 200 + 3 for j in range(12 + i)] for i in range(5)]
    lens = [8, 8, 8, 8, 3]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lens]
    outs = eng.generate(prompts, params)
    exact = sum(torch.equal(o, eng.runner.model(g.padded(b), eng.runner.pool)[: b.input_ids.numel()]) for b, o in seen)
    plain = Engine(loaded=loaded, kernels="triton", device=str(dev), kv_cache_tokens=kv, max_running=16,
                   cuda_graphs=False)
    again = plain.generate(prompts, params)
    alone = [plain.generate([p], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))[0].token_ids
             for p, n in zip(prompts, lens, strict=True)]
    return {"replays": len(seen), "replays_bit_exact": exact, "buckets": sorted(g.static),
            "tokens_equal_without_graphs": [o.token_ids for o in outs] == [o.token_ids for o in again],
            "alone_equals_batched": alone == [o.token_ids for o in again],
            "ok": exact == len(seen) > 0 and [o.token_ids for o in outs] == [o.token_ids for o in again]}


def smollm2(dev: torch.device, dry: bool) -> dict[str, Any]:
    """The embedded model on the Triton backend (float32) vs transformers on the same device."""
    from transformers import AutoModelForCausalLM

    from tripod.loader.embedded import embedded_model_path

    n = 3 if dry else 24
    eng = Engine(kernels="triton", dtype="float32", device=str(dev), kv_cache_tokens=256 if dry else 4096)
    path = embedded_model_path()
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).to(dev)
    texts = ["Write a haiku about rivers.", "What is 17 * 23?", "Name three colours."][: 1 if dry else 3]
    res = []
    for t in texts:
        ids = list(eng.apply_chat_template([{"role": "user", "content": t}]))
        (out,) = eng.generate([ids], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids], device=dev), max_new_tokens=n, min_new_tokens=n, do_sample=False)
        want = ref[0, len(ids):].tolist()
        res.append({"prompt": t, "equal": out.token_ids == want, "tripod": out.token_ids, "hf": want})
    return {"tokens": n, "prompts": res, "ok": all(r["equal"] for r in res)}


def throughput(dev: torch.device, dry: bool, name: str, shape: dict[str, Any], cs: list[int], prompt: int,
               out_len: int, ceil: dict[str, Any], deadline_s: float) -> dict[str, Any]:
    """Output tok/s, TTFT and TPOT per concurrency on random weights, with the ceilings' ratios."""
    dt = torch.float32 if dry else torch.bfloat16
    t0 = time.perf_counter()
    loaded = rm.random_model(shape, dt, dev)
    made_s = time.perf_counter() - t0
    params = rm.parameter_count(shape)
    eng = Engine(loaded=loaded, device=str(dev), kernels="triton", max_running=max(cs),
                 max_batch_tokens=max(8192, prompt), chunk_size=max(2048, prompt),
                 kv_cache_tokens=max(cs) * (prompt + out_len) + 64 if dry else None)
    rows = []
    g = torch.Generator().manual_seed(0)
    for c in cs:
        if time.perf_counter() - t0 > deadline_s:
            rows.append({"C": c, "skipped": "out of time"})
            continue
        ids = [torch.randint(3, min(shape["vocab_size"], 40000), (prompt,), generator=g).tolist() for _ in range(c)]
        rows.append(_one_load(eng, ids, out_len, dev, params, dt, ceil, t0 + deadline_s) | {"C": c})
    card = eng.runner.card()
    eng.close()
    del eng, loaded
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()  # the next model gets the memory back
    return {"model": name, "parameters": params, "made_in_s": made_s, "prompt": prompt, "out": out_len,
            "card": card, "rows": rows}


def _one_load(eng: Engine, ids: list[list[int]], out_len: int, dev: torch.device, params: int, dt: torch.dtype,
              ceil: dict[str, Any], stop_at: float) -> dict[str, Any]:
    sp = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    reqs = [r for p in ids for r in eng.add_request(p, sp)]
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    produced = 0
    while eng.has_work and time.perf_counter() < stop_at:
        for o in eng.step():
            now = time.perf_counter()
            k = id(o.req)
            if o.new_token_ids:
                first.setdefault(k, now)
                last[k] = now
                produced += len(o.new_token_ids)
    wall = time.perf_counter() - start
    finished = not eng.has_work
    for r in reqs:  # (what the deadline cut short)
        eng.abort(r.rid)
    ttft = sorted(first[k] - start for k in first)
    tpot = sorted((last[k] - first[k]) / (out_len - 1) for k in first if out_len > 1)
    p50 = lambda v: v[len(v) // 2] if v else float("nan")  # noqa: E731
    weight_bytes = params * torch.empty((), dtype=dt).element_size()
    floor_ms = weight_bytes / (ceil["copy_GBps"] * 1e9 / 2) * 1e3  # one read of the weights at the copy rate
    step_s = p50(tpot)
    c = len(ids)
    return {"output_tok_s": produced / wall, "ttft_p50_ms": p50(ttft) * 1e3, "tpot_p50_ms": step_s * 1e3,
            "tpot_vs_weight_read": step_s * 1e3 / floor_ms if step_s == step_s else None,
            "linear_share_of_gemm_peak": (2 * params * c / step_s) / (ceil["gemm_TFLOPs"] * 1e12) if step_s else None,
            "finished": finished, "wall_s": wall}


def write(out: Path, report: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str))
    lines = [f"# tripod GPU check — {report['date']}", "", f"- device: {report['device']}",
             f"- torch {report['torch']}, triton {report['triton']}, dry run: {report['dry_run']}", ""]
    for name, sec in report["sections"].items():
        lines += [f"## {name} ({sec.get('seconds', 0):.1f} s)", ""]
        if "error" in sec:
            lines += ["```", sec["error"][-1500:], "```", ""]
            continue
        lines += ["```json", json.dumps(sec["result"], indent=1, default=str)[:6000], "```", ""]
    (out / "gpu_check.md").write_text("\n".join(lines))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results/gpu/latest"))
    ap.add_argument("--dry-run", action="store_true", help="the CPU, Triton's interpreter, toy shapes")
    ap.add_argument("--budget-s", type=float, default=450.0, help="stop starting sections after this long")
    args = ap.parse_args()
    dry = args.dry_run
    if not dry and not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run on the CPU", file=sys.stderr)
        return 2
    dev = torch.device("cpu" if dry else "cuda")
    import triton

    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "dry_run": dry, "torch": torch.__version__,
        "triton": triton.__version__, "python": platform.python_version(), "sections": {},
        "device": "CPU (Triton interpreter)" if dry else torch.cuda.get_device_name(0),
    }
    t_start = time.perf_counter()
    out = Path(args.out)
    ceil: dict[str, Any] = {"copy_GBps": math.nan, "gemm_TFLOPs": math.nan}
    cs8, csv2 = ([1, 4], [1, 4]) if dry else ([1, 16, 64, 256], [1, 64])
    prompt, out_len = (16, 4) if dry else (1024, 256)
    left = lambda: args.budget_s - (time.perf_counter() - t_start)  # noqa: E731
    plan: list[tuple[str, Any]] = [
        ("kernels", lambda: kernels(dev, dry)),
        ("graphs", lambda: graphs(dev, dry)),
        ("smollm2_vs_hf", lambda: smollm2(dev, dry)),
        ("ceilings", lambda: ceil.update(ceilings(dev, dry)) or dict(ceil)),
        ("llama_8b_shape", lambda: throughput(dev, dry, "Llama-3.1-8B shape", rm.TINY_LLAMA if dry else rm.LLAMA_8B,
                                              cs8, prompt, out_len, ceil, max(30.0, left() * 0.6))),
        ("deepseek_v2_lite_shape", lambda: throughput(dev, dry, "DeepSeek-V2-Lite shape",
                                                      rm.TINY_DEEPSEEK if dry else rm.DEEPSEEK_V2_LITE, csv2, prompt,
                                                      out_len, ceil, max(30.0, left() - 10))),
    ]
    failed = 0
    for name, fn in plan:
        if left() <= 0:
            report["sections"][name] = {"error": "skipped: out of time", "seconds": 0.0}
            continue
        t = time.perf_counter()
        try:
            result = fn()
            report["sections"][name] = {"result": result, "seconds": time.perf_counter() - t}
            ok = result.get("ok", True) if isinstance(result, dict) else all(r.get("ok", True) for r in result)
            failed += 0 if ok else 1
        except Exception:
            report["sections"][name] = {"error": traceback.format_exc(), "seconds": time.perf_counter() - t}
            failed += 1
        print(f"[{time.perf_counter() - t_start:6.1f} s] {name}: "
              f"{'error' if 'error' in report['sections'][name] else 'done'}", flush=True)
        write(out, report)
    print(f"wrote {out / 'gpu_check.json'} and {out / 'gpu_check.md'}; {failed} section(s) failed or differed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
