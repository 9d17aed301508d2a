"""Multi-head latent attention (DeepSeek-V2/V3) over a latent KV pool.

The pool keeps, per token and layer, MLA's compressed state only: the normalized KV latent
(``kv_lora_rank``) and the rotated shared rope key (``qk_rope_head_dim``). Nothing per head.

- Decode and verification rows use the *absorbed* form: ``W_UK`` (the K half of ``kv_b_proj``)
  is folded into the query (``q_nope · W_UK`` → a query in latent space), the scores are taken
  against the latents themselves, and ``W_UV`` is applied after attention to the latent-space
  output. A decode step never expands the cache: it reads ``latent_dim`` values per cached token
  instead of ``2 · heads · head_dim``.
- Prefill chunks expand: the chunk's (and its cached prefix's) latents go through ``kv_b_proj``
  once into per-head K/V, then one causal attention, which is cheaper for many queries at once.

Both are equal to Hugging Face's expanded attention up to float rounding (tests compare greedy
tokens against transformers on the absorbed and the expanded path).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tripod.layers.attention import sdpa, window_mask
from tripod.layers.batch import Backend, ForwardBatch
from tripod.layers.linear import Fp8Scales, Linear, dequantize_fp8
from tripod.layers.mlp import keep
from tripod.layers.norm import rms_norm
from tripod.layers.parallel import SINGLE, ParallelGroup, columns, parameter, rows
from tripod.layers.rotary import apply_rotary
from tripod.layers.topk import topk_by_position
from tripod.layers.weights import WeightSource
from tripod.memory.kv_pool import LatentPool


@dataclass(frozen=True, slots=True)
class MLAConfig:
    """Multi-head latent attention: K/V compressed to a ``kv_lora_rank`` latent per token plus one
    shared ``qk_rope_head_dim`` rotary key."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None  # None: Q is one projection (DeepSeek-V2-Lite)
    rope_interleave: bool = True  # the rope dims come in (even, odd) pairs in the checkpoint
    # No positional encoding (Kimi Linear): the "rope" key channels stay shared across heads but
    # are never rotated (the step then needs no cos/sin tables).
    nope: bool = False
    # DeepSeek-V3.2's sparse attention: a lightning indexer (``index_n_heads`` small heads of
    # ``index_head_dim``, one key per token) picks each query's ``index_topk`` past tokens.
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def pool_dim(self) -> int:
        """A token's values in the pool per layer: the latent, then the indexer's key (V3.2)."""
        return self.latent_dim + self.index_head_dim


class Indexer(nn.Module):
    """DeepSeek-V3.2's lightning indexer: scores every visible past token for a query as
    ``sum_h w_h(x) * relu(q_h · k / sqrt(d))`` (``q_h`` from the query's low-rank state, one key per
    token, LayerNorm'ed, both rotated on their first ``rope`` dims, half-split) and keeps the
    ``topk`` best; attention then runs over those only. Keys live in the latent pool's rows, after
    the latent. ``pruned`` counts the queries that attended fewer tokens than they could see."""

    def __init__(self, cfg: MLAConfig, hidden: int, dtype: torch.dtype) -> None:
        super().__init__()
        assert cfg.q_lora_rank is not None, "the indexer reads the query's low-rank state"
        self.n, self.d, self.topk, self.rope = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk, cfg.qk_rope_head_dim
        self.wq = _param(self.n * self.d, cfg.q_lora_rank, dtype=dtype)
        self.wk = _param(self.d, hidden, dtype=dtype)
        self.k_norm = _param(self.d, dtype=dtype)
        self.k_norm_bias = _param(self.d, dtype=dtype)
        self.w = _param(self.n, hidden, dtype=dtype)
        self.pruned = 0

    def load(self, src: WeightSource, prefix: str) -> None:
        self.wq.data = src.get(prefix + "wq_b.weight")
        self.wk.data = src.get(prefix + "wk.weight")
        self.k_norm.data = src.get(prefix + "k_norm.weight")
        self.k_norm_bias.data = src.get(prefix + "k_norm.bias")
        self.w.data = src.get(prefix + "weights_proj.weight")

    def _rotate(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        r = self.rope
        return torch.cat((apply_rotary(x[..., :r], *cos_sin), x[..., r:]), dim=-1)

    def keys(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Each token's key ``[T, d]`` (to store in the pool)."""
        k = F.layer_norm(F.linear(x, self.wk), (self.d,), self.k_norm, self.k_norm_bias, 1e-6)
        return self._rotate(k[:, None], cos_sin)[:, 0]

    def queries(self, x: torch.Tensor, q_low: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's query heads ``[T, n, d]`` and their weights ``[T, n]`` (float32)."""
        q = self._rotate(F.linear(q_low, self.wq).view(-1, self.n, self.d), cos_sin)
        return q.float(), F.linear(x, self.w).float() * self.n**-0.5

    def select(self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """``visible`` ``[R, L]`` narrowed to each row's ``topk`` best-scored keys (``keys``
        ``[R, L, d]``, or ``[L, d]`` shared by the rows)."""
        if visible.shape[-1] <= self.topk:
            return visible  # nothing to leave out
        k = keys.float()
        dots = torch.einsum("rhd,ld->rhl", q, k) if k.dim() == 2 else torch.einsum("rhd,rld->rhl", q, k)
        scores = torch.einsum("rh,rhl->rl", w, F.relu(dots * self.d**-0.5))
        top = topk_by_position(scores.masked_fill(~visible, float("-inf")), self.topk)[1]
        keep = torch.zeros_like(visible).scatter_(-1, top, True) & visible
        self.pruned += int((keep.sum(-1) < visible.sum(-1)).sum())
        return keep


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class MLAttention(nn.Module):
    """One layer's latent attention: projections in, attention over the latent pool, ``o_proj``."""

    def __init__(self, cfg: MLAConfig, hidden: int, num_heads: int, eps: float, scale: float,
                 bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.cfg, self.h, self.eps, self.scale = cfg, num_heads, eps, scale
        qd = num_heads * cfg.qk_head_dim
        if cfg.q_lora_rank is None:
            self.q = _param(qd, hidden, dtype=dtype)
            self.q_a = self.q_a_norm = None
        else:
            self.q_a = _param(cfg.q_lora_rank, hidden, dtype=dtype)
            self.q_a_norm = _param(cfg.q_lora_rank, dtype=dtype)
            self.q = _param(qd, cfg.q_lora_rank, dtype=dtype)  # q_b_proj
        self.kv_a = _param(cfg.latent_dim, hidden, dtype=dtype)
        self.kv_a_norm = _param(cfg.kv_lora_rank, dtype=dtype)
        self.kv_b = _param(num_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank, dtype=dtype)
        self.o = _param(hidden, num_heads * cfg.v_head_dim, dtype=dtype)
        if bias:
            raise ValueError("MLA checkpoints with attention biases are not supported")
        self.indexer = Indexer(cfg, hidden, dtype) if cfg.index_topk else None
        self.ops: dict[str, dict[str, Linear]] = {}
        self.fp8: dict[str, Fp8Scales] = {}
        self.tp = SINGLE

    def shard(self, tp: ParallelGroup) -> None:
        """Tensor parallel by heads: this rank's rows of the Q and ``kv_b`` projections and
        columns of O; the latent projection (and so the latent pool) is replicated on every rank."""
        c = self.cfg
        h0, h1 = tp.split(self.h, "number of attention heads")
        per_kv = c.qk_nope_head_dim + c.v_head_dim
        self.q = parameter(rows(self.q.data, (h0 * c.qk_head_dim, h1 * c.qk_head_dim)))
        self.kv_b = parameter(rows(self.kv_b.data, (h0 * per_kv, h1 * per_kv)))
        self.o = parameter(columns(self.o.data, h0 * c.v_head_dim, h1 * c.v_head_dim))
        self.h = h1 - h0
        self.ops.clear()
        self.tp = tp

    def prepare(self, backend: Backend, stored: Any = None) -> None:
        form = backend.form
        if form in self.ops:
            return
        names = {"q": self.q, "kv_a": self.kv_a, "kv_b": self.kv_b, "o": self.o}
        if self.q_a is not None:
            names["q_a"] = self.q_a
        self.ops[form] = {k: backend.linear(w, None, fp8=self.fp8.get(k)) for k, w in names.items()}
        c = self.cfg
        # The absorbed form's per-head factors of kv_b_proj: [H, nope, r] and [H, v, r].
        kv_b = self.kv_b if "kv_b" not in self.fp8 else dequantize_fp8(self.kv_b, self.fp8["kv_b"], self.kv_a_norm.dtype)
        kvb = kv_b.view(self.h, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
        self.w_uk = kvb[:, : c.qk_nope_head_dim]
        self.w_uv = kvb[:, c.qk_nope_head_dim :]

    def release(self, form: str) -> None:
        self.ops.pop(form, None)

    def load(self, src: WeightSource, prefix: str) -> None:
        """The projections as the checkpoint has them; Q's and the shared key's rope rows
        reordered (so those two run in the run dtype even when the others stay FP8: a row
        permutation would cross FP8 blocks)."""
        c = self.cfg
        perm_q = _deinterleave(c.qk_nope_head_dim, c.qk_rope_head_dim, c.rope_interleave)
        if self.q_a is None:
            self.q.data = _permute_heads(src.get(prefix + "q_proj.weight"), self.h, perm_q)
        else:
            assert self.q_a_norm is not None
            keep(self, "q_a", src.part(prefix + "q_a_proj.weight"))
            self.q_a_norm.data = src.get(prefix + "q_a_layernorm.weight")
            self.q.data = _permute_heads(src.get(prefix + "q_b_proj.weight"), self.h, perm_q)
        perm_kv = _deinterleave(c.kv_lora_rank, c.qk_rope_head_dim, c.rope_interleave)
        self.kv_a.data = src.get(prefix + "kv_a_proj_with_mqa.weight")[perm_kv].contiguous()
        self.kv_a_norm.data = src.get(prefix + "kv_a_layernorm.weight")
        keep(self, "kv_b", src.part(prefix + "kv_b_proj.weight"))
        keep(self, "o", src.part(prefix + "o_proj.weight"))
        if self.indexer is not None:
            self.indexer.load(src, prefix + "indexer.")

    def forward(
        self,
        x: torch.Tensor,
        layer: int,
        pool: LatentPool,
        batch: ForwardBatch,
        cos_sin: tuple[torch.Tensor, torch.Tensor] | None,
        residual: torch.Tensor,
    ) -> torch.Tensor:
        c, ops = self.cfg, self.ops[batch.backend.form]

        def rotate(t: torch.Tensor) -> torch.Tensor:
            if c.nope:
                return t
            assert cos_sin is not None, "MLA with RoPE needs the step's cos/sin tables"
            return apply_rotary(t, *cos_sin)

        t = x.shape[0]
        q_low = None
        if self.q_a is not None:
            assert self.q_a_norm is not None
            q_low = rms_norm(ops["q_a"](x), self.q_a_norm, self.eps)
            q = ops["q"](q_low)
        else:
            q = ops["q"](x)
        q = q.view(t, self.h, c.qk_head_dim)
        q_nope, q_pe = q[..., : c.qk_nope_head_dim], rotate(q[..., c.qk_nope_head_dim :])
        ckv = ops["kv_a"](x)
        parts = [rms_norm(ckv[:, : c.kv_lora_rank], self.kv_a_norm, self.eps),
                 rotate(ckv[:, None, c.kv_lora_rank :])[:, 0]]
        ix = self.indexer
        if ix is not None:  # V3.2: the indexer's key joins the latent in the pool; its queries for this step
            assert q_low is not None and cos_sin is not None
            parts.append(ix.keys(x, cos_sin).to(x.dtype))
            iq, iw = ix.queries(x, q_low, cos_sin)
        row = torch.cat(parts, dim=-1)
        pool.write(layer, batch.out_slots, row)
        dim = c.latent_dim  # a pool row: the latent [:dim], then (V3.2) the indexer's key
        out = torch.empty(t, self.h, c.v_head_dim, dtype=x.dtype, device=x.device)
        nd = batch.num_decode
        if nd:
            assert batch.decode_kv_idx is not None and batch.decode_mask is not None
            fused = self._absorbed_kernel(q_nope[:nd], q_pe[:nd], pool, layer, batch) if ix is None else None
            if fused is not None:
                out[:nd] = fused
            else:
                lat = pool.gather(layer, batch.decode_kv_idx)  # [B, L, pool row]
                mask = batch.decode_mask
                if ix is not None:
                    mask = ix.select(iq[:nd], iw[:nd], lat[..., dim:], mask[:, 0, 0])[:, None, None, :]
                out[:nd] = self._absorbed(q_nope[:nd], q_pe[:nd], lat[..., :dim], mask)
        for s0, p0, n, kv in batch.verifies:
            lat = pool.gather(layer, kv)  # [p0 + n, pool row]
            p = torch.arange(p0, p0 + n, device=x.device)
            seen = window_mask(p, torch.arange(p0 + n, device=x.device), None)
            if ix is not None:
                seen = ix.select(iq[s0 : s0 + n], iw[s0 : s0 + n], lat[:, dim:], seen)
            out[s0 : s0 + n] = self._absorbed(
                q_nope[s0 : s0 + n], q_pe[s0 : s0 + n], lat[:, :dim].unsqueeze(0).expand(n, -1, -1),
                seen[:, None, None, :],
            )
        for seg in batch.prefills:
            s, n = seg.start, seg.length
            if seg.prefix_len == 0:
                rows, mask, causal = row[s : s + n], None, True
            else:
                assert seg.kv_slots is not None
                rows, mask, causal = pool.gather(layer, seg.kv_slots), seg.mask, False
            if ix is not None and rows.shape[0] > ix.topk:
                if mask is None:
                    mask = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
                mask, causal = ix.select(iq[s : s + n], iw[s : s + n], rows[:, dim:], mask), False
            out[s : s + n] = self._expanded(q_nope[s : s + n], q_pe[s : s + n], rows[:, :dim], mask, causal, ops)
        return self.tp.reduce(ops["o"](out.view(t, -1), residual=self.tp.residual(residual)))

    def _absorbed_kernel(self, q_nope: torch.Tensor, q_pe: torch.Tensor, pool: LatentPool, layer: int,
                         batch: ForwardBatch) -> torch.Tensor | None:
        """The decode rows on the backend's absorbed-MLA kernel, reading the pool in place (None:
        the backend has none, or this pool is one rank's range of a data-parallel group)."""
        if pool.base or batch.decode_kv_idx is None:
            return None
        q_lat = torch.einsum("bhn,hnr->bhr", q_nope, self.w_uk)
        lens = (batch.positions[: q_nope.shape[0]] + 1).to(torch.int32)
        o = batch.backend.latent_attention(torch.cat((q_lat, q_pe), dim=-1), pool.kv[layer], batch.decode_kv_idx,
                                           lens, self.cfg.kv_lora_rank, self.scale)
        return None if o is None else torch.einsum("bhr,hvr->bhv", o, self.w_uv)

    def _absorbed(self, q_nope: torch.Tensor, q_pe: torch.Tensor, lat: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Rows ``[B, H, *]`` each attending its own latents ``[B, L, latent]`` (``mask``
        ``[B, 1, 1, L]``) without expanding them → ``[B, H, v_head_dim]``."""
        r = self.cfg.kv_lora_rank
        q_lat = torch.einsum("bhn,hnr->bhr", q_nope, self.w_uk)
        qf = torch.cat((q_lat, q_pe), dim=-1).unsqueeze(2)  # [B, H, 1, r + rope]
        keys = lat.unsqueeze(1)  # [B, 1, L, r + rope]: one latent "head" shared by all heads
        o = sdpa(qf, keys, keys[..., :r], mask, self.scale)  # [B, H, 1, r]
        return torch.einsum("bhr,hvr->bhv", o.squeeze(2), self.w_uv)

    def _expanded(self, q_nope: torch.Tensor, q_pe: torch.Tensor, lat: torch.Tensor,
                  mask: torch.Tensor | None, causal: bool, ops: dict[str, Linear]) -> torch.Tensor:
        """A prefill chunk ``[n, H, *]`` over latents ``[S, latent]`` expanded to per-head K/V."""
        c = self.cfg
        s = lat.shape[0]
        kv = ops["kv_b"](lat[:, : c.kv_lora_rank]).view(s, self.h, c.qk_nope_head_dim + c.v_head_dim)
        k = torch.cat((kv[..., : c.qk_nope_head_dim], lat[:, None, c.kv_lora_rank :].expand(s, self.h, -1)), dim=-1)
        v = kv[..., c.qk_nope_head_dim :]
        q = torch.cat((q_nope, q_pe), dim=-1)
        o = sdpa(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
                 mask, self.scale, causal=causal)
        return o[0].transpose(0, 1)


def _deinterleave(lead: int, rope: int, interleaved: bool) -> torch.Tensor:
    """Row order that keeps ``lead`` rows and turns ``rope`` rows from (even, odd) pairs into
    halves (all evens, then all odds): rotating both Q and K that way gives the same dot products
    as DeepSeek's pairwise rotation, with the half-split RoPE every other model uses."""
    idx = torch.arange(lead + rope)
    if interleaved:
        r = torch.arange(rope)
        idx[lead:] = lead + torch.cat((r[0::2], r[1::2]))
    return idx


def _permute_heads(w: torch.Tensor, heads: int, perm: torch.Tensor) -> torch.Tensor:
    d = w.shape[0] // heads
    return w.view(heads, d, -1)[:, perm].reshape(w.shape).contiguous()
