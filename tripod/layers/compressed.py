"""DeepSeek-V4's attention: one shared K=V head over a sliding window, plus compressed entries.

Every layer attends a sliding window of per-token keys (``window`` tokens, the query's own
included). A *compressed* layer also attends entries that each summarise a block of ``rate``
tokens: a softmax-gated sum of the block's projected tokens (per channel), normalized and
rotated at the block's first position.

- HCA (heavily compressed attention): non-overlapping blocks; the query sees every entry whose
  block is complete.
- CSA (compressed sparse attention): entry ``w`` mixes two series, the first half of block
  ``w - 1``'s projection and the second half of block ``w``'s (width ``2 · rate``, stride
  ``rate``); a lightning indexer (its own small compressor and query heads) scores the complete
  entries and the query attends only its ``index_topk`` best.

Where the cache lives: in the latent pool's row of each token (``CompressedAttnConfig.row``).
A token's row holds its own key, its projected compressor inputs (kv, gate + the block position's
bias), and — for the token that *closes* a block — that block's compressed entry (and the
indexer's compressed key). Every value in a row is a function of the tokens up to it, so a radix
prefix hit at any token is exact: the entries of the complete blocks are in the shared rows, and
the pending block's inputs are there to finish it. The price is the projected inputs kept per
token (see ``benchmarks/kv_bytes.py``); a pool that drops them once their block is closed (and
keys outside the window) would hold far less.

Queries: ``q_a`` → RMSNorm (the low-rank state, which the indexer reads too) → ``q_b`` → a
weightless RMSNorm per head → RoPE on each head's last ``rope_dim`` channels (interleaved pairs;
the main base on sliding layers, the compressed base on the others). The output's rope channels
are rotated back by the query's position; the heads go through a grouped low-rank output
projection (``o_groups`` blocks to ``o_lora_rank`` each, then ``o_b``). Attention sinks as in
gpt-oss. Computed on torch's ops, per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tripod.layers.attention import sdpa, window_mask
from tripod.layers.batch import ForwardBatch
from tripod.layers.norm import rms_norm
from tripod.layers.rotary import rope_inv_freq
from tripod.layers.topk import topk_by_position
from tripod.layers.weights import WeightSource

KINDS = ("sliding", "csa", "hca")


@dataclass(frozen=True, slots=True)
class CompressedAttnConfig:
    """The attention shape of a DeepSeek-V4 model."""

    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    window: int
    kinds: tuple[str, ...]  # per layer: "sliding" | "csa" | "hca"
    csa_rate: int
    hca_rate: int
    index_heads: int
    index_dim: int
    index_topk: int
    main_theta: float
    compress_theta: float
    compress_scaling: dict[str, Any] | None = None

    def rate(self, kind: str) -> int:
        return self.csa_rate if kind == "csa" else self.hca_rate

    def layout(self, kind: str) -> dict[str, tuple[int, int]]:
        """A ``kind`` layer's parts in a token's pool row: name → (offset, width)."""
        d, i = self.head_dim, self.index_dim
        widths = [("key", d)]
        if kind == "hca":
            widths += [("kv", d), ("gate", d), ("entry", d)]
        elif kind == "csa":
            widths += [("kv", 2 * d), ("gate", 2 * d), ("entry", d), ("ikv", 2 * i), ("igate", 2 * i), ("ikey", i)]
        out, at = {}, 0
        for name, w in widths:
            out[name] = (at, w)
            at += w
        return out

    def row(self, kind: str) -> int:
        return sum(w for _, w in self.layout(kind).values())

    @property
    def row_dim(self) -> int:
        """A token's values per layer in the pool (the widest layer's row)."""
        return max(self.row(k) for k in set(self.kinds))

    def steady_values(self, kind: str) -> float:
        """Values per token per layer a pool needs once blocks are closed and keys left the window
        (long contexts): the compressed entries (and indexer keys) over their block."""
        if kind == "csa":
            return (self.head_dim + self.index_dim) / self.csa_rate
        if kind == "hca":
            return self.head_dim / self.hca_rate
        return 0.0


class InterleavedRope:
    """cos/sin per position for RoPE over (even, odd) channel pairs of the last ``dim`` channels."""

    def __init__(self, dim: int, theta: float, scaling: dict[str, Any] | None, max_position: int,
                 device: torch.device) -> None:
        inv_freq, _ = rope_inv_freq(dim, theta, scaling, max_position)  # (V4 keeps YaRN's scale at 1)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        self.cos, self.sin, self.dim = freqs.cos().to(device), freqs.sin().to(device), dim

    def rotate(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """``x`` ``[T, heads, D]`` rotated at ``positions`` ``[T]`` (``inverse``: by minus the angle)."""
        c = self.cos.index_select(0, positions)[:, None]
        s = self.sin.index_select(0, positions)[:, None]
        if inverse:
            s = -s
        r = x[..., x.shape[-1] - self.dim :].float()
        a, b = r[..., 0::2], r[..., 1::2]
        rot = torch.stack((a * c - b * s, b * c + a * s), dim=-1).flatten(-2).to(x.dtype)
        return torch.cat((x[..., : x.shape[-1] - self.dim], rot), dim=-1)


def unweighted_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.zeros(*shape, dtype=dtype), requires_grad=False)


class _Compressor(nn.Module):
    """A block compressor's weights: projections of each token to (kv, gate) and the per-position
    gate bias; ``two`` series (CSA: width 2·dim, the first half feeding the next block)."""

    def __init__(self, hidden: int, dim: int, rate: int, two: bool, dtype: torch.dtype) -> None:
        super().__init__()
        w = 2 * dim if two else dim
        self.dim, self.rate, self.two = dim, rate, two
        self.kv = _param(w, hidden, dtype=dtype)
        self.gate = _param(w, hidden, dtype=dtype)
        self.bias = _param(rate, w, dtype=torch.float32)
        self.norm = _param(dim, dtype=dtype)

    def load(self, src: WeightSource, prefix: str) -> None:
        self.kv.data = src.get(prefix + "kv_proj.weight")
        self.gate.data = src.get(prefix + "gate_proj.weight")
        self.bias.data = src.get_f32(prefix + "position_bias")
        self.norm.data = src.get(prefix + "kv_norm.weight")

    def inputs(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's (kv, gate with its block position's bias) → stored in its row."""
        gate = F.linear(x, self.gate) + self.bias.index_select(0, positions % self.rate).to(x.dtype)
        return F.linear(x, self.kv), gate

    def entries(self, kv: torch.Tensor, gate: torch.Tensor, first: int, eps: float, rope: InterleavedRope
                ) -> torch.Tensor:
        """Blocks ``first ..`` of one sequence from the rows of their tokens: ``kv``/``gate``
        ``[tokens, w]`` starting at block ``first - 1``'s first token (CSA; at block ``first``'s
        for HCA) → entries ``[blocks, dim]``."""
        m, d = self.rate, self.dim
        bk, bg = kv.view(-1, m, kv.shape[-1]), gate.view(-1, m, gate.shape[-1])
        if not self.two:
            k, g = bk, bg
        else:  # entry w: block w - 1's first series, then block w's second
            prev_k, prev_g = bk[:-1, :, :d], bg[:-1, :, :d]
            cur_k, cur_g = bk[:, :, d:], bg[:, :, d:]
            if first > 0:  # the rows start one block early, for the first entry's previous block
                cur_k, cur_g = cur_k[1:], cur_g[1:]
            else:  # block 0 has no previous block: an empty series (weight 0)
                prev_k = torch.cat((bk.new_zeros(1, m, d), prev_k))
                prev_g = torch.cat((bg.new_full((1, m, d), float("-inf")), prev_g))
            k, g = torch.cat((prev_k, cur_k), dim=1), torch.cat((prev_g, cur_g), dim=1)
        n = k.shape[0]
        mixed = (k * g.softmax(dim=1, dtype=torch.float32).to(k.dtype)).sum(dim=1)
        out = rms_norm(mixed, self.norm, eps)
        pos = (torch.arange(n, device=kv.device) + first) * m
        return rope.rotate(out[:, None], pos)[:, 0]


class CompressedAttention(nn.Module):
    """One DeepSeek-V4 attention layer (sliding, CSA or HCA) over the latent pool's rows."""

    def __init__(self, cfg: CompressedAttnConfig, kind: str, hidden: int, num_heads: int, eps: float,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.cfg, self.kind, self.h, self.eps = cfg, kind, num_heads, eps
        d = cfg.head_dim
        self.scale = d**-0.5
        self.q_a = _param(cfg.q_lora_rank, hidden, dtype=dtype)
        self.q_a_norm = _param(cfg.q_lora_rank, dtype=dtype)
        self.q_b = _param(num_heads * d, cfg.q_lora_rank, dtype=dtype)
        self.kv = _param(d, hidden, dtype=dtype)
        self.kv_norm = _param(d, dtype=dtype)
        self.o_a = _param(cfg.o_groups * cfg.o_lora_rank, num_heads * d // cfg.o_groups, dtype=dtype)
        self.o_b = _param(hidden, cfg.o_groups * cfg.o_lora_rank, dtype=dtype)
        self.sinks = _param(num_heads, dtype=torch.float32)
        self.comp: _Compressor | None = None
        self.index: _Compressor | None = None
        if self.kind != "sliding":
            rate = cfg.rate(self.kind)
            self.comp = _Compressor(hidden, d, rate, self.kind == "csa", dtype)
        if self.kind == "csa":
            self.index = _Compressor(hidden, cfg.index_dim, cfg.csa_rate, True, dtype)
            self.index_q = _param(cfg.index_heads * cfg.index_dim, cfg.q_lora_rank, dtype=dtype)
            self.index_w = _param(cfg.index_heads, hidden, dtype=dtype)
        self.parts = cfg.layout(self.kind)
        self.selected = 0  # entries the indexer kept, summed over queries (CSA)
        self.complete = 0  # entries those queries could see

    def load(self, src: WeightSource, prefix: str) -> None:
        self.q_a.data = src.get(prefix + "q_a_proj.weight")
        self.q_a_norm.data = src.get(prefix + "q_a_norm.weight")
        self.q_b.data = src.get(prefix + "q_b_proj.weight")
        self.kv.data = src.get(prefix + "kv_proj.weight")
        self.kv_norm.data = src.get(prefix + "kv_norm.weight")
        self.o_a.data = src.get(prefix + "o_a_proj.weight")
        self.o_b.data = src.get(prefix + "o_b_proj.weight")
        self.sinks.data = src.get_f32(prefix + "sinks")
        if self.comp is not None:
            self.comp.load(src, prefix + "compressor.")
        if self.index is not None:
            p = prefix + "compressor.indexer."
            self.index.load(src, p)
            self.index_q.data = src.get(p + "q_b_proj.weight")
            self.index_w.data = src.get(p + "scorer.weights_proj.weight")

    def _part(self, rows: torch.Tensor, name: str) -> torch.Tensor:
        at, w = self.parts[name]
        return rows[..., at : at + w]

    def forward(self, x: torch.Tensor, layer: int, pool: Any, batch: ForwardBatch,
                ropes: tuple[InterleavedRope, InterleavedRope]) -> torch.Tensor:
        cfg, t, pos = self.cfg, x.shape[0], batch.positions
        rope = ropes[0] if self.kind == "sliding" else ropes[1]
        q_low = rms_norm(F.linear(x, self.q_a), self.q_a_norm, self.eps)
        q = unweighted_rms(F.linear(q_low, self.q_b).view(t, self.h, cfg.head_dim), self.eps)
        q = rope.rotate(q, pos)
        key = rope.rotate(rms_norm(F.linear(x, self.kv), self.kv_norm, self.eps)[:, None], pos)[:, 0]
        parts = [key]
        iq = iw = None
        if self.comp is not None:
            parts += [*self.comp.inputs(x, pos), x.new_zeros(t, cfg.head_dim)]
        if self.index is not None:
            parts += [*self.index.inputs(x, pos), x.new_zeros(t, cfg.index_dim)]
            iq = ropes[1].rotate(F.linear(q_low, self.index_q).view(t, cfg.index_heads, cfg.index_dim), pos).float()
            iw = F.linear(x, self.index_w).float() * cfg.index_heads**-0.5
        row = torch.cat(parts, dim=-1)
        if row.shape[-1] < pool.latent_dim:
            row = F.pad(row, (0, pool.latent_dim - row.shape[-1]))
        pool.write(layer, batch.out_slots, row)
        out = torch.empty(t, self.h, cfg.head_dim, dtype=x.dtype, device=x.device)
        for s, p0, n, slots in _segments(batch):
            if self.comp is not None:
                self._close_blocks(layer, pool, slots, p0, n, ropes[1])
            out[s : s + n] = self._attend(q[s : s + n], layer, pool, slots, p0, n,
                                          None if iq is None else iq[s : s + n], None if iw is None else iw[s : s + n])
        out = rope.rotate(out, pos, inverse=True)
        g = cfg.o_groups
        grouped = out.reshape(t, g, -1).transpose(0, 1)  # [g, T, heads·dim / g]
        w = self.o_a.view(g, cfg.o_lora_rank, -1).transpose(1, 2)  # [g, in, o_lora_rank]
        low = torch.bmm(grouped, w).transpose(0, 1).reshape(t, -1)
        return F.linear(low, self.o_b)

    def _close_blocks(self, layer: int, pool: Any, slots: torch.Tensor, p0: int, n: int, rope: InterleavedRope) -> None:
        """Compute the entries of the blocks this segment's tokens complete and write each into
        the row of the token that closes it."""
        assert self.comp is not None
        m = self.comp.rate
        w0, w1 = p0 // m, (p0 + n) // m
        if w1 <= w0:
            return
        lo = (w0 - 1) * m if self.comp.two and w0 > 0 else w0 * m
        rows = pool.gather(layer, slots[lo : w1 * m])
        entries = [self.comp.entries(self._part(rows, "kv"), self._part(rows, "gate"), w0, self.eps, rope)]
        names = ["entry"]
        if self.index is not None:
            entries.append(self.index.entries(self._part(rows, "ikv"), self._part(rows, "igate"), w0, self.eps, rope))
            names.append("ikey")
        ends = slots[(torch.arange(w0, w1, device=slots.device) + 1) * m - 1]
        closing = pool.gather(layer, ends)
        for name, e in zip(names, entries, strict=True):
            at, w = self.parts[name]
            closing[:, at : at + w] = e.to(closing.dtype)
        pool.write(layer, ends, closing)

    def _attend(self, q: torch.Tensor, layer: int, pool: Any, slots: torch.Tensor, p0: int, n: int,
                iq: torch.Tensor | None, iw: torch.Tensor | None) -> torch.Tensor:
        """Queries at positions ``p0 .. p0 + n - 1`` of one sequence (``slots``: its tokens' from 0)
        over their window of keys and the complete blocks' entries (CSA: the indexed ones)."""
        cfg, dev = self.cfg, q.device
        hi = p0 + n
        lo = max(0, p0 - cfg.window + 1)
        q_pos = torch.arange(p0, hi, device=dev)
        keys = self._part(pool.gather(layer, slots[lo:hi]), "key")
        mask = window_mask(q_pos, torch.arange(lo, hi, device=dev), cfg.window)
        if self.comp is not None:
            m = self.comp.rate
            blocks = hi // m
            if blocks:
                closing = pool.gather(layer, slots[m - 1 : blocks * m : m])
                seen = torch.arange(blocks, device=dev)[None, :] < ((q_pos + 1) // m)[:, None]
                if self.index is not None and blocks > cfg.index_topk:
                    assert iq is not None and iw is not None
                    seen = self._select(iq, iw, self._part(closing, "ikey").float(), seen)
                keys = torch.cat((keys, self._part(closing, "entry")))
                mask = torch.cat((mask, seen), dim=1)
        kv = keys[None, None]  # [1, 1, L, dim]: one K=V head shared by every query head
        o = sdpa(q.transpose(0, 1)[None], kv, kv, mask, self.scale, sinks=self.sinks)
        return o[0].transpose(0, 1)

    def _select(self, iq: torch.Tensor, iw: torch.Tensor, ikeys: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
        """``seen`` ``[n, blocks]`` narrowed to each query's ``index_topk`` best-scored entries:
        ``sum_h w_h · relu(q_h · k) / sqrt(dim)``."""
        scores = F.relu(torch.einsum("qhd,ed->qhe", iq, ikeys)) * self.cfg.index_dim**-0.5
        scores = (scores * iw[..., None]).sum(dim=1)
        top = topk_by_position(scores.masked_fill(~seen, float("-inf")), self.cfg.index_topk)[1]
        keep = torch.zeros_like(seen).scatter_(-1, top, True) & seen
        self.selected += int(keep.sum())
        self.complete += int(seen.sum())
        return keep


def _segments(batch: ForwardBatch) -> list[tuple[int, int, int, torch.Tensor]]:
    """(flat start, first position, rows, the sequence's slots from position 0) of every run of
    one sequence's tokens in the batch: decodes, verifications, prefill chunks."""
    out = []
    if batch.num_decode:
        assert batch.decode_kv_idx is not None
        for i, p in enumerate(batch.positions[: batch.num_decode].tolist()):
            out.append((i, p, 1, batch.decode_kv_idx[i, : p + 1]))
    for s0, p0, n, kv in batch.verifies:
        out.append((s0, p0, n, kv))
    for seg in batch.prefills:
        slots = seg.kv_slots if seg.prefix_len else batch.out_slots[seg.start : seg.start + seg.length]
        assert slots is not None
        out.append((seg.start, seg.prefix_len, seg.length, slots))
    return out
