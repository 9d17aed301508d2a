"""Every Triton kernel against its reference op (the reference backend's torch code), in Triton's
interpreter on CPU tensors, float32 and float16 (the interpreter has no bfloat16), on small
shapes that cover the edges: ragged lengths, key-block and split boundaries, one-token chunks,
chunks after a prefix-cache hit, GQA ratios 1/4/8, head dims 64/128/256 and MLA's 512 + 64,
sliding windows, soft-capped logits and attention sinks."""

from __future__ import annotations

import math

import pytest
import torch

from tripod.kernels import gpu
from tripod.layers.activation import activate
from tripod.layers.attention import sdpa
from tripod.layers.norm import rms_norm
from tripod.layers.rotary import RotaryEmbedding, apply_rotary

ops = gpu.ops()
F32, F16 = torch.float32, torch.float16


def matrix(names: str, values: list[tuple], default: set[tuple]) -> pytest.MarkDecorator:  # type: ignore[type-arg]
    """Parametrize over every combination; those outside ``default`` run with the long tests
    (``slow``): the interpreter is slow, and the default run keeps one case per edge."""
    return pytest.mark.parametrize(names, [v if v in default else pytest.param(*v, marks=pytest.mark.slow)
                                           for v in values])


TOL = {torch.float32: 2e-5, torch.float16: 2e-3}


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    err = (got.float() - want.float()).abs().max().item()
    scale = max(1.0, want.float().abs().max().item())
    assert err <= TOL[dtype] * scale * 4, f"{what}: max error {err:.3g} (scale {scale:.3g})"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n", [64, 100])
def test_rms_norm_with_and_without_the_residual(dtype: torch.dtype, n: int) -> None:
    g = torch.Generator().manual_seed(n)
    x = torch.randn(7, n, generator=g).to(dtype)
    res = torch.randn(7, n, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(n, generator=g)).to(dtype)
    out, none = ops.rms_norm(x, w, 1e-6)
    assert none is None
    _close(out, rms_norm(x.float(), w.float(), 1e-6), dtype, "rms_norm")
    out, total = ops.rms_norm(x, w, 1e-6, residual=res)
    assert total is not None
    _close(total, x.float() + res.float(), dtype, "residual sum")
    _close(out, rms_norm(x.float() + res.float(), w.float(), 1e-6), dtype, "rms_norm(x + residual)")
    wide = torch.randn(3, 2 * n, generator=g).to(dtype)[:, :n]  # strided rows
    _close(ops.rms_norm(wide, w, 1e-6)[0], rms_norm(wide.float(), w.float(), 1e-6), dtype, "strided rows")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_silu_mul(dtype: torch.dtype) -> None:
    gu = torch.randn(5, 2 * 1500, generator=torch.Generator().manual_seed(1)).to(dtype)  # two column blocks
    _close(ops.silu_mul(gu, 1500), activate(gu.float(), 1500, "silu"), dtype, "silu_mul")
    assert ops.silu_mul(gu[:0], 1500).shape == (0, 1500)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("nh", "nkv", "d"), [(4, 4, 64), (8, 2, 128), (16, 2, 16)])
def test_rope_and_kv_write(dtype: torch.dtype, nh: int, nkv: int, d: int) -> None:
    g = torch.Generator().manual_seed(d)
    rot = RotaryEmbedding(d, 10000.0, None, 64, torch.device("cpu"))
    t = 5
    qkv = torch.randn(t, (nh + 2 * nkv) * d, generator=g).to(dtype)
    pos = torch.tensor([0, 3, 17, 40, 63])
    slots = torch.tensor([9, -1, 2, 0, 5])  # -1: a padded row, nothing written
    kv = torch.zeros(12, 2, nkv, d, dtype=dtype)
    heads = qkv.float().view(t, -1, d)
    cos, sin = rot.tables(pos, torch.float32)
    want_qk = apply_rotary(heads[:, : nh + nkv], cos, sin)
    ops.rope_store_kv(qkv, pos, rot.cos, rot.sin, kv, slots, nh, nkv)
    got = qkv.float().view(t, -1, d)
    _close(got[:, : nh + nkv], want_qk, dtype, "rotated Q/K")
    _close(got[:, nh + nkv :], heads[:, nh + nkv :], dtype, "V untouched")
    for i, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        _close(kv[s, 0], want_qk[i, nh:], dtype, "K in the pool")
        _close(kv[s, 1], heads[i, nh + nkv :], dtype, "V in the pool")
    written = {s for s in slots.tolist() if s >= 0}
    assert all(not kv[s].any() for s in range(12) if s not in written), "a padded row wrote to the pool"


def _reference_attention(q: torch.Tensor, kv: torch.Tensor, table: torch.Tensor, rows: list[int], lens: list[int],
                         scale: float, window: int | None, softcap: float | None,
                         sinks: torch.Tensor | None) -> torch.Tensor:
    """Token by token with the torch path's ``sdpa`` (float32)."""
    out = torch.zeros(q.shape, dtype=torch.float32)
    for t, (r, n) in enumerate(zip(rows, lens, strict=True)):
        lo = max(0, n - window) if window else 0
        if n == 0:
            continue
        slots = table[r, lo:n].long()
        k = kv[slots, 0].float().transpose(0, 1).unsqueeze(0)  # [1, KVH, L, D]
        v = kv[slots, 1].float().transpose(0, 1).unsqueeze(0)
        o = sdpa(q[t].float()[None, :, None, :], k, v, None, scale, softcap, sinks=sinks)
        out[t] = o[0, :, 0]
    return out


def _ragged_case(nh: int, nkv: int, d: int, dtype: torch.dtype, seed: int):
    """Three requests: one decoding at 70 keys, one prefill chunk of 9 after a 37-token cached
    prefix, a one-token chunk at position 0, and a verify run of 3 at 50; slots scattered."""
    g = torch.Generator().manual_seed(seed)
    width = 96
    table = torch.randperm(4 * width, generator=g)[: 4 * width].view(4, width).to(torch.int32)
    kv = torch.randn(4 * width, 2, nkv, d, generator=g).to(dtype)
    items = [(0, 69, 1), (1, 37, 9), (2, 0, 1), (3, 50, 3)]  # (table row, first position, tokens)
    rows, lens, starts, counts = [], [], [], []
    for r, p0, n in items:
        starts.append(len(rows))
        counts.append(n)
        rows += [r] * n
        lens += list(range(p0 + 1, p0 + n + 1))
    q = torch.randn(len(rows), nh, d, generator=g).to(dtype)
    return q, kv, table, rows, lens, starts, counts


@matrix("dtype,nh,nkv,d,splits",
        [(dt, *shape, sp) for dt in (F32, F16) for shape in ((4, 4, 64), (8, 2, 128), (8, 1, 256), (4, 2, 16))
         for sp in (1, 3)],
        {(F32, 4, 4, 64, 1), (F32, 8, 2, 128, 3), (F16, 8, 1, 256, 3), (F16, 4, 2, 16, 1)})
def test_paged_attention_on_a_ragged_batch(dtype: torch.dtype, nh: int, nkv: int, d: int, splits: int) -> None:
    q, kv, table, rows, lens, starts, counts = _ragged_case(nh, nkv, d, dtype, seed=d + nh)
    scale = 1 / math.sqrt(d)
    want = _reference_attention(q, kv, table, rows, lens, scale, None, None, None)
    for many in (False, True):
        bm, _ = ops.tile(nh // nkv, many)
        blocks = torch.tensor(ops.query_blocks(starts, counts, bm), dtype=torch.int32).view(-1, 2)
        got = ops.paged_attention(q, kv, table, torch.tensor(rows, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32),
                                  blocks, bm, scale, split_keys=32 * (4 - splits), splits=splits, block_n=16)
        _close(got, want, dtype, f"paged attention (blocks of {bm}, {splits} splits)")


@pytest.mark.parametrize("dtype", [F32, pytest.param(F16, marks=pytest.mark.slow)])
def test_paged_attention_window_softcap_and_sinks(dtype: torch.dtype) -> None:
    nh, nkv, d = 8, 2, 64
    q, kv, table, rows, lens, starts, counts = _ragged_case(nh, nkv, d, dtype, seed=3)
    sinks = torch.randn(nh, generator=torch.Generator().manual_seed(4))
    r_t, l_t = torch.tensor(rows, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)
    for window, softcap, snk in [(12, None, None), (None, 5.0, None), (None, None, sinks), (20, 30.0, sinks)]:
        want = _reference_attention(q, kv, table, rows, lens, 0.125, window, softcap, snk)
        for splits in (1, 2):
            bm, _ = ops.tile(nh // nkv, True)
            blocks = torch.tensor(ops.query_blocks(starts, counts, bm), dtype=torch.int32).view(-1, 2)
            got = ops.paged_attention(q, kv, table, r_t, l_t, blocks, bm, 0.125, split_keys=96 // splits, splits=splits,
                                      window=window, softcap=softcap, sinks=snk, block_n=16)
            _close(got, want, dtype, f"window {window}, softcap {softcap}, sinks {snk is not None}, {splits} splits")


def test_a_tokens_attention_does_not_depend_on_its_batch() -> None:
    """A token's result is the same bits whatever else is in the step (other requests, later
    tokens of its own chunk, hence other key ranges and split contents): cut each item's run just
    after the token and run it alone. (Its row within the query tile is kept: the interpreter's
    matmul is NumPy's BLAS, whose microkernel rounds rows by their position in the tile, which a
    GPU's tensor cores do not; across rows, results agree to float32 rounding.)"""
    nh, nkv, d = 8, 2, 64
    q, kv, table, rows, lens, starts, counts = _ragged_case(nh, nkv, d, torch.float32, seed=5)
    r_t, l_t = torch.tensor(rows, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)
    bm, _ = ops.tile(nh // nkv, True)
    for kw in (dict(split_keys=96, splits=1, block_n=16), dict(split_keys=32, splits=3, block_n=16, window=40)):
        together = ops.paged_attention(q, kv, table, r_t, l_t, torch.tensor(ops.query_blocks(starts, counts, bm),
                                       dtype=torch.int32).view(-1, 2), bm, 0.125, **kw)
        for s0, n in zip(starts, counts, strict=True):
            for t in range(s0, s0 + n):
                first = s0 + (t - s0) // bm * bm  # the token's query block in the batched run
                cut = torch.tensor([[0, t - first + 1]], dtype=torch.int32)
                alone = ops.paged_attention(q[first : t + 1], kv, table, r_t[first : t + 1], l_t[first : t + 1], cut,
                                            bm, 0.125, **kw)
                assert torch.equal(alone[-1], together[t]), f"token {t} alone differs from batched ({kw})"
                single = ops.paged_attention(q[t : t + 1], kv, table, r_t[t : t + 1], l_t[t : t + 1],
                                             torch.tensor([[0, 1]], dtype=torch.int32), 1, 0.125, **kw)
                _close(single[0], together[t], torch.float32, f"token {t} as a decode block")


def test_a_padded_row_attends_nothing_and_writes_zeros() -> None:
    q, kv, table, rows, lens, _starts, _counts = _ragged_case(4, 2, 16, torch.float32, seed=6)
    lens[0] = 0  # a graph's padding row
    blocks = torch.tensor(ops.query_blocks([0], [1], 1), dtype=torch.int32).view(-1, 2)
    got = ops.paged_attention(q[:1], kv, table, torch.tensor(rows[:1], dtype=torch.int32),
                              torch.tensor(lens[:1], dtype=torch.int32), blocks, 1, 0.25, split_keys=48, splits=2,
                              block_n=16)
    assert torch.equal(got, torch.zeros_like(got))


def _reference_mla(q: torch.Tensor, lat: torch.Tensor, idx: torch.Tensor, lens: list[int], rank: int,
                   scale: float) -> torch.Tensor:
    """The torch path's absorbed decode (``MLAttention._absorbed``'s attention): one latent "head"
    shared by every query head."""
    out = torch.zeros(q.shape[0], q.shape[1], rank)
    for b, n in enumerate(lens):
        rows = lat[idx[b, :n].long()].float()[:, : q.shape[-1]]
        keys = rows[None, None]  # [1, 1, L, rank + rope]
        o = sdpa(q[b].float()[None, :, None, :], keys, keys[..., :rank], None, scale)
        out[b] = o[0, :, 0]
    return out


@matrix("dtype,heads,rank,rope,row,splits",
        [(dt, *shape, sp) for dt in (F32, F16) for shape in ((4, 16, 8, 24), (16, 512, 64, 576), (20, 512, 64, 592))
         for sp in (1, 2)],
        {(F32, 4, 16, 8, 24, 2), (F16, 16, 512, 64, 576, 1), (F32, 20, 512, 64, 592, 2)})
def test_mla_absorbed_decode(dtype: torch.dtype, heads: int, rank: int, rope: int, row: int, splits: int) -> None:
    """DeepSeek-V3's shapes (512 + 64, and with V3.2's indexer key after the latent) and a tiny one;
    20 heads: two head blocks, the second partly padded."""
    g = torch.Generator().manual_seed(rank + heads)
    lens = [1, 37, 64]
    width = 64
    lat = (torch.randn(200, row, generator=g) * 0.5).to(dtype)
    idx = torch.stack([torch.randperm(200, generator=g)[:width] for _ in lens])
    q = (torch.randn(len(lens), heads, rank + rope, generator=g) * 0.1).to(dtype)
    scale = 1 / math.sqrt(rank + rope)
    want = _reference_mla(q, lat, idx, lens, rank, scale)
    got = ops.mla_decode(q, lat, idx, torch.tensor(lens, dtype=torch.int32), rank, scale,
                         split_keys=width // splits, splits=splits)
    _close(got, want, dtype, "MLA absorbed decode")


@pytest.mark.parametrize("dtype", [F32, F16])
def test_grammar_bitmask_applied_on_the_device(dtype: torch.dtype) -> None:
    """XGrammar's packed bitmask (bit t % 32 of word t // 32, 1 = allowed) on the constrained rows
    only: a vocabulary that is not a multiple of 32 nor of the kernel's block, rows in any order."""
    import numpy as np

    vocab, width = 2500, 2560  # logits wider than the vocabulary: the extra columns are left alone
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(5, width, generator=gen).to(dtype)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, words), generator=gen, dtype=torch.int64).to(torch.int32)
    bitmask[1] = 0  # a row that allows nothing
    rows = [4, 0, 2]
    want = logits.clone()
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab].astype(bool)
    for j, r in enumerate(rows):
        want[r, :vocab][torch.from_numpy(~bits[j])] = float("-inf")
    got = logits.clone()
    ops.apply_bitmask(got, bitmask, torch.tensor(rows), vocab)
    assert torch.equal(got, want)
    assert torch.isinf(got[0, :vocab]).all() and torch.equal(got[1], logits[1]) and torch.equal(got[3], logits[3])
