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
from torch import nn

from tripod.layers.attention import ForwardBatch, sdpa, window_mask
from tripod.layers.backends.base import Backend
from tripod.layers.linear import Fp8Scales, Linear, dequantize_fp8
from tripod.layers.mlp import keep
from tripod.layers.norm import rms_norm
from tripod.layers.parallel import SINGLE, ParallelGroup, columns, parameter, rows
from tripod.layers.rotary import apply_rotary
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

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


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

    def forward(
        self,
        x: torch.Tensor,
        layer: int,
        pool: LatentPool,
        batch: ForwardBatch,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        residual: torch.Tensor,
    ) -> torch.Tensor:
        c, ops = self.cfg, self.ops[batch.backend.form]
        t = x.shape[0]
        if self.q_a is not None:
            assert self.q_a_norm is not None
            q = ops["q"](rms_norm(ops["q_a"](x), self.q_a_norm, self.eps))
        else:
            q = ops["q"](x)
        q = q.view(t, self.h, c.qk_head_dim)
        q_nope, q_pe = q[..., : c.qk_nope_head_dim], apply_rotary(q[..., c.qk_nope_head_dim :], *cos_sin)
        ckv = ops["kv_a"](x)
        latent = torch.cat(
            (rms_norm(ckv[:, : c.kv_lora_rank], self.kv_a_norm, self.eps),
             apply_rotary(ckv[:, None, c.kv_lora_rank :], *cos_sin)[:, 0]),
            dim=-1,
        )
        pool.write(layer, batch.out_slots, latent)
        out = torch.empty(t, self.h, c.v_head_dim, dtype=x.dtype, device=x.device)
        nd = batch.num_decode
        if nd:
            assert batch.decode_kv_idx is not None and batch.decode_mask is not None
            lat = pool.gather(layer, batch.decode_kv_idx)  # [B, L, latent]
            out[:nd] = self._absorbed(q_nope[:nd], q_pe[:nd], lat, batch.decode_mask)
        for s0, p0, n, kv in batch.verifies:
            lat = pool.gather(layer, kv)  # [p0 + n, latent]
            p = torch.arange(p0, p0 + n, device=x.device)
            mask = window_mask(p, torch.arange(p0 + n, device=x.device), None)[:, None, None, :]
            out[s0 : s0 + n] = self._absorbed(
                q_nope[s0 : s0 + n], q_pe[s0 : s0 + n], lat.unsqueeze(0).expand(n, -1, -1), mask
            )
        for seg in batch.prefills:
            s, n = seg.start, seg.length
            if seg.prefix_len == 0:
                lat, mask, causal = latent[s : s + n], None, True
            else:
                assert seg.kv_slots is not None
                lat, mask, causal = pool.gather(layer, seg.kv_slots), seg.mask, False
            out[s : s + n] = self._expanded(q_nope[s : s + n], q_pe[s : s + n], lat, mask, causal, ops)
        return self.tp.reduce(ops["o"](out.view(t, -1), residual=self.tp.residual(residual)))

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
