"""Load a freshly built kernel library in this (throw-away) process and check every op against
its torch reference on small random inputs. Exit 0 and print a summary when all agree.

    python -m tripod.kernels.selftest path/to/tripod_avx2.so tripod_avx2
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from tripod.kernels import reference


def check(lib: str, namespace: str) -> list[str]:
    torch.ops.load_library(lib)
    ops = getattr(torch.ops, namespace)
    gen = torch.Generator().manual_seed(0)
    lines = []
    for dtype, tol in ((torch.float32, 2e-5), (torch.bfloat16, 2e-2)):
        for heads, kvh, d in ((9, 3, 64), (8, 8, 128), (4, 1, 32)):
            slots = 1500
            kv = torch.randn(slots, 2, kvh, d, generator=gen).to(dtype)
            table = torch.randperm(slots, generator=gen)[:1400].view(2, 700).to(torch.int32)
            # Two decode rows (one long enough to be split), then a prefill chunk of 20 queries.
            rows = torch.tensor([0, 1] + [1] * 20, dtype=torch.int32)
            lens = torch.tensor([700, 37, *list(range(600, 620))], dtype=torch.int32)
            q = torch.randn(len(rows), heads, d, generator=gen).to(dtype)
            got = ops.paged_attention(q, kv, table, rows, lens, d**-0.5)
            want = reference.paged_attention(q, kv, table, rows, lens, d**-0.5)
            err = (got.float() - want.float()).abs().max().item()
            assert err < tol, f"paged_attention {dtype} H={heads} KVH={kvh} D={d}: max error {err}"
            lines.append(f"paged_attention {dtype} H={heads} KVH={kvh} D={d}: max error {err:.2e}")

            width = (heads + 2 * kvh) * d
            qkv = torch.randn(5, width, generator=gen).to(dtype)
            pos = torch.tensor([0, 3, 9, 100, 2], dtype=torch.long)
            cos = torch.randn(128, d, generator=gen)
            sin = torch.randn(128, d, generator=gen)
            pool_a = torch.zeros(16, 2, kvh, d, dtype=dtype)
            pool_b = pool_a.clone()
            sl = torch.tensor([3, 1, 7, 15, 0], dtype=torch.long)
            a, b = qkv.clone(), qkv.clone()
            ops.rope_store_kv(a, pos, cos, sin, pool_a, sl, heads, kvh)
            reference.rope_store_kv(b, pos, cos, sin, pool_b, sl, heads, kvh)
            err = max((a.float() - b.float()).abs().max().item(), (pool_a.float() - pool_b.float()).abs().max().item())
            rtol = 0.0 if dtype == torch.float32 else 2e-2
            assert err <= rtol * max(1.0, b.float().abs().max().item()), f"rope_store_kv {dtype}: max error {err}"
            lines.append(f"rope_store_kv {dtype} H={heads} KVH={kvh} D={d}: max error {err:.2e}")
        gu = torch.randn(7, 2 * 1536, generator=gen).to(dtype)
        err = (ops.silu_mul(gu).float() - reference.silu_mul(gu).float()).abs().max().item()
        assert err < (1e-5 if dtype == torch.float32 else 2e-2), f"silu_mul {dtype}: max error {err}"
        lines.append(f"silu_mul {dtype}: max error {err:.2e}")
        x = torch.randn(6, 576, generator=gen).to(dtype)
        w = torch.randn(576, generator=gen).to(dtype)
        err = (ops.rms_norm(x, w, 1e-5).float() - reference.rms_norm(x, w, 1e-5).float()).abs().max().item()
        assert err < (1e-5 if dtype == torch.float32 else 3e-2), f"rms_norm {dtype}: max error {err}"
        lines.append(f"rms_norm {dtype}: max error {err:.2e}")
        # A linear layer over packed weights (outputs not a multiple of 16: the masked tail).
        n, k = 70, 96
        w = torch.randn(n, k, generator=gen).to(dtype)
        fmt = "bf16" if dtype == torch.bfloat16 else "f32"
        x = torch.randn(5, k, generator=gen).to(dtype)
        got = ops.linear_packed(x, ops.pack_linear(w if fmt == "bf16" else w.float(), fmt, n, k), fmt, n, k, None)
        want = x.float() @ w.float().T
        err = (got.float() - want).abs().max().item()
        assert err < (1e-4 if dtype == torch.float32 else 0.15), f"linear_packed {fmt}: max error {err}"
        lines.append(f"linear_packed {fmt}: max error {err:.2e}")
    lines += _check_recurrences(ops, gen)
    # W8A8's int8 product (VNNI is chosen at run time: an instruction this CPU lacks dies here)
    q = torch.randint(-128, 128, (5, 100), dtype=torch.int8, generator=gen)
    w = torch.randint(-128, 128, (18, 100), dtype=torch.int8, generator=gen)
    assert torch.equal(ops.int8_linear(q, w).long(), q.long() @ w.long().T), f"int8_linear ({ops.int8_path()}) is not exact"
    lines.append(f"int8_linear ({ops.int8_path()}): exact")
    if namespace.endswith(("amx_bf16", "amx_emu")):  # the bf16 linear above ran on tiles only if granted
        status = ops.amx_status()
        assert "granted" in status or "emulated" in status, f"{namespace}: {status}"
        lines.append(status)
        lines += _check_stored_tiles(ops, gen)
        for what, rows in order_probe(ops).items():
            assert all(v == 0.0 for v in rows), f"{what}: not TDPBF16PS' documented order (even element first): {rows}"
        lines.append("TDPBF16PS' order (a pair's even element first) on tiles and on the few-row path")
    return lines


def _check_recurrences(ops: Any, gen: torch.Generator) -> list[str]:
    """The hybrid mixers' recurrences (csrc/recurrent.cpp) on two items at scattered slots, one of
    them traced (its per-row states kept), against the plain-torch loops."""
    lines = []
    t, slots = 9, 4
    items = torch.tensor([[0, 6, 2, 0], [6, 3, 0, -1]], dtype=torch.int64)
    x, w, b = torch.randn(t, 40, generator=gen), torch.randn(40, 4, generator=gen), torch.randn(40, generator=gen)
    win = torch.randn(slots, 40, 3, generator=gen)
    want_win = win.clone()
    got = ops.conv_update(x, win, items, w, b, torch.empty(7, 40, 3))
    want = reference.conv_update(x, want_win, items, w, b)
    err = max((got - want).abs().max().item(), (win - want_win).abs().max().item())
    assert err < 1e-5, f"conv_update: max error {err}"
    lines.append(f"conv_update: max error {err:.2e}")
    q = torch.nn.functional.normalize(torch.randn(t, 2, 20, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(t, 2, 20, generator=gen), dim=-1)
    v, decay, beta = torch.randn(t, 4, 24, generator=gen), torch.rand(t, 4, generator=gen), torch.rand(t, 4, generator=gen)
    state = torch.randn(slots, 4, 20, 24, generator=gen)
    want_state = state.clone()
    got = ops.gated_delta(q, k, v, decay, beta, state, items, torch.empty(7, 4, 20, 24))
    want = reference.gated_delta(q, k, v, decay, beta, want_state, items)
    err = max((got - want).abs().max().item(), (state - want_state).abs().max().item())
    assert err < 1e-4, f"gated_delta: max error {err}"
    lines.append(f"gated_delta: max error {err:.2e}")
    xbc, dt = torch.randn(t, 3 * 40 + 2 * 16, generator=gen), torch.rand(t, 3, generator=gen)
    ssm = torch.randn(slots, 3, 40, 16, generator=gen)
    want_ssm = ssm.clone()
    args = (xbc[:, :120], xbc[:, 120:136], xbc[:, 136:], dt, decay[:, :3].contiguous())
    got = ops.ssd_scan(*args, ssm, items, torch.empty(7, 3, 40, 16))
    want = reference.ssd_scan(*args, want_ssm, items)
    err = max((got - want).abs().max().item(), (ssm - want_ssm).abs().max().item())
    assert err < 1e-4 * max(1.0, want.abs().max().item()), f"ssd_scan: max error {err}"
    lines.append(f"ssd_scan: max error {err:.2e}")
    return lines


def order_probe(ops: object) -> dict[str, list[float]]:
    """A sum whose value shows the order in which a pair's two products are added: per output, the
    pairs (1, 0) then (2^24, -2^24). A pair's even element first (TDPBF16PS): 1 + 2^24 rounds to
    2^24, and then 0. Its odd element first (vdpbf16ps): 1 - 2^24 is exact, and then 1. Returns the
    first output of 1 row and of each of 19 rows, stored q8_0 codes (scale 1) and dense bf16."""
    n, k = 16, 32
    x = torch.zeros(19, k)
    x[:, 0], x[:, 2], x[:, 3] = 1.0, 2.0**24, -(2.0**24)
    x = x.to(torch.bfloat16)
    codes = torch.zeros(n, 32, dtype=torch.int8)
    codes[:, [0, 2, 3]] = 1
    blocks = torch.cat([torch.ones(n, 1, dtype=torch.float16).view(torch.uint8), codes.view(torch.uint8)], dim=1)
    dense = codes.to(torch.bfloat16)
    out = {}
    for fmt, w in (("q8_0", blocks), ("bf16", dense)):
        packed = ops.pack_linear(w.contiguous(), fmt, n, k)
        rows = [ops.linear_packed(x[:1], packed, fmt, n, k, None)[0, 0].item()]
        rows += ops.linear_packed(x, packed, fmt, n, k, None)[:, 0].float().tolist()
        out[fmt] = rows
    return out


def wide(m: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """bf16 activations spread over 2^-12 .. 2^12: their products' sums round in float32 (randn's
    alone mostly sum exactly, whatever the order), so a change of summation order shows in the bits."""
    return (torch.randn(m, k, generator=gen) * torch.exp2(torch.randint(-12, 13, (m, k), generator=gen).float())).to(torch.bfloat16)


def stored_blocks(fmt: str, n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Random GGUF blocks of ``fmt`` as ``pack_linear`` takes them (uint8 [n, k / 32 * bytes]) with
    sane scales: q4_0 [d fp16, 16 bytes of nibbles], q4_1 [d, m fp16, nibbles], q8_0 [d, 32 int8],
    q4_k [a, b float32, nibbles], q6_k [a0, a1 float32, 32 int8]."""
    kb = k // 32
    scale_dtype, n_scales, n_codes = {
        "q4_0": (torch.float16, 1, 16), "q4_1": (torch.float16, 2, 16), "q8_0": (torch.float16, 1, 32),
        "q4_k": (torch.float32, 2, 16), "q6_k": (torch.float32, 2, 32),
    }[fmt]
    scales = (torch.rand(n, kb, n_scales, generator=gen) * 0.05 + 0.001).to(scale_dtype)
    codes = torch.randint(0, 256, (n, kb, n_codes), generator=gen, dtype=torch.uint8)
    if fmt == "q6_k":  # codes - 32 of 6-bit codes: [-32, 31]
        codes = (codes % 64).to(torch.int16).sub(32).to(torch.int8).view(torch.uint8)
    return torch.cat([scales.view(torch.uint8).reshape(n, kb, -1), codes], dim=2).reshape(n, -1).contiguous()


def _check_stored_tiles(ops: object, gen: torch.Generator) -> list[str]:
    """Stored blocks with bf16 activations on the tile levels: more rows than a register tile run on
    tiles, one row on vdpbf16ps in TDPBF16PS' documented order, so each row must come out with the
    same bits alone as in the batch. On AMX hardware this checks the hardware's order."""
    lines = []
    n, k = 40, 128
    for fmt in ("q4_0", "q4_1", "q8_0", "q4_k", "q6_k"):
        w = ops.pack_linear(stored_blocks(fmt, n, k, gen), fmt, n, k)
        x = wide(19, k, gen)
        batch = ops.linear_packed(x, w, fmt, n, k, None)
        for r in (0, 7, 16, 18):
            alone = ops.linear_packed(x[r : r + 1], w, fmt, n, k, None)
            assert torch.equal(alone[0], batch[r]), f"{fmt} on tiles: row {r} alone differs from the batch"
        lines.append(f"linear_packed {fmt}@bf16 on tiles: rows alone = batched")
    return lines


if __name__ == "__main__":
    for line in check(sys.argv[1], sys.argv[2]):
        print(line)
