"""Paged (page size 1) attention over the KV pool, for a flat batch of mixed work.

``attend`` is the attention block after the QKV projection: per-head q/k RMSNorm (when the
layer has it), then the step's compute backend (``layers/backends``) rotates Q/K, writes this
step's K/V into the pool and attends. A layer's ``AttnSpec`` carries its heads, scale, optional
sliding window and logit soft-cap; it and the batch (``ForwardBatch``, ``PrefillSegment``,
``KernelMeta``) live in ``layers/batch.py``, beside the ``Backend`` interface that reads them.

The torch path (``paged_attention`` below; the reference and torch backends, and CUDA): a step's
tokens are laid out flat: first one token per decoding request, then each prefill chunk's
tokens. Decodes attend in one padded, batched SDPA call (over the dense decode mirror, or
gathered); each prefill chunk attends to its cached prefix plus itself with a causal mask.
Sliding-window layers and soft-capped logits run here only. tripod's CPU kernels (the cpu
backend) read the pool through the slot table instead (``KernelMeta``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tripod.layers.batch import AttnSpec, ForwardBatch, PrefillSegment
from tripod.layers.rotary import RotaryEmbedding
from tripod.memory.kv_pool import KVPool


def attend(
    qkv: torch.Tensor,
    layer: int,
    pool: KVPool,
    batch: ForwardBatch,
    rotary: RotaryEmbedding,
    cos_sin: tuple[torch.Tensor, torch.Tensor] | None,
    spec: AttnSpec,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """The attention block after the QKV projection: (normalize Q/K per head,) then the batch's
    backend rotates Q/K, writes this step's K/V into the pool and attends.
    ``qkv`` ``[T, (H + 2 KVH) * D]`` → ``[T, H * D]``."""
    t = qkv.shape[0]
    d = pool.head_dim
    nh, nkv = spec.num_heads, spec.num_kv_heads
    backend = batch.backend
    if qk_norm is not None:
        qw, kw, eps = qk_norm
        heads = qkv.view(t, -1, d)
        q_n = backend.head_norm(heads[:, :nh], qw, eps)
        k_n = backend.head_norm(heads[:, nh : nh + nkv], kw, eps)
        qkv = torch.cat((q_n.reshape(t, -1), k_n.reshape(t, -1), qkv[:, (nh + nkv) * d :]), dim=1)
    return backend.attend(qkv, layer, pool, batch, rotary, cos_sin, spec)


def sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None = None,
    causal: bool = False,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """``scaled_dot_product_attention`` (grouped-query), or spelled out for soft-capped logits or
    attention sinks (``[H]``: one more logit per head in the softmax, whose probability is dropped)."""
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True)
    rep = q.shape[-3] // k.shape[-3]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    if causal:
        lq, lk = s.shape[-2], s.shape[-1]
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.matmul(torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype), v)
    sink = sinks.to(s.dtype).view(-1, 1, 1).expand(*s.shape[:-1], 1)
    both = torch.cat((s, sink), dim=-1)
    both = both - both.max(dim=-1, keepdim=True).values  # (as transformers: the sink can be the largest)
    p = torch.softmax(both, dim=-1, dtype=both.dtype)[..., :-1]
    return torch.matmul(p.to(v.dtype), v)


def window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Causal (and sliding-window) visibility: ``[len(q_pos), len(k_pos)]`` bool."""
    q, k = q_pos.unsqueeze(1), k_pos.unsqueeze(0)
    m = k <= q
    if window is not None:
        m &= k > q - window
    return m


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer: int,
    pool: KVPool,
    batch: ForwardBatch,
    spec: AttnSpec,
) -> torch.Tensor:
    """q ``[T, H, D]``, k/v ``[T, KVH, D]`` (already rotated) → ``[T, H, D]``.

    Writes this step's K/V into the pool first, so decodes read their own token from it.
    """
    pool.write(layer, batch.out_slots, k, v)
    out = torch.empty_like(q)
    if batch.num_decode:
        _decode_attention(q, k, v, layer, pool, batch, spec, out)
    for s0, p0, n, kv in batch.verifies:
        _verify_attention(q, layer, pool, spec, s0, p0, n, kv, out)
    for seg in batch.prefills:
        _prefill_attention(q, k, v, layer, pool, spec, seg, out)
    return out


def _decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, pool: KVPool,
                      batch: ForwardBatch, spec: AttnSpec, out: torch.Tensor) -> None:
    """The decode rows, batched over the padded slot table (or the dense decode mirror)."""
    nd, dev = batch.num_decode, q.device
    assert batch.decode_mask is not None
    width = batch.decode_mask.shape[-1]
    if batch.decode_mirror is not None:
        rows = batch.decode_mirror[layer]
        rows[torch.arange(nd, device=dev), batch.positions[:nd]] = torch.stack((k[:nd], v[:nd]), dim=1)
        dense = rows[:nd, :width]  # [B, L, 2, KVH, D]
        kc, vc = dense.select(2, 0), dense.select(2, 1)
    else:
        assert batch.decode_kv_idx is not None
        kc, vc = pool.gather(layer, batch.decode_kv_idx)  # [B, L, KVH, D] each
    kc, vc = kc.transpose(1, 2), vc.transpose(1, 2)
    mask = batch.decode_mask
    if spec.window is not None:
        keys = torch.arange(width, device=dev).unsqueeze(0)
        mask = mask & (keys > batch.positions[:nd].unsqueeze(1) - spec.window)[:, None, None, :]
    o = sdpa(q[:nd].unsqueeze(2), kc, vc, mask, spec.scale, spec.softcap, sinks=spec.sinks)
    out[:nd] = o.squeeze(2)


def _verify_attention(q: torch.Tensor, layer: int, pool: KVPool, spec: AttnSpec, s0: int, p0: int, n: int,
                      kv: torch.Tensor, out: torch.Tensor) -> None:
    """A verify item's rows, position by position like plain decoding."""
    dev = q.device
    kc, vc = pool.gather(layer, kv)  # [p0 + n, KVH, D] each
    kc, vc = kc.unsqueeze(0).transpose(1, 2), vc.unsqueeze(0).transpose(1, 2)
    for j in range(n):
        w = p0 + j + 1
        mask = _all_true(w, dev)
        if spec.window is not None:
            mask = mask & (torch.arange(w, device=dev) > w - 1 - spec.window)
        o = sdpa(q[s0 + j : s0 + j + 1].unsqueeze(2), kc[:, :, :w], vc[:, :, :w], mask, spec.scale, spec.softcap, sinks=spec.sinks)
        out[s0 + j] = o[0, :, 0]


def _prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, pool: KVPool,
                       spec: AttnSpec, seg: PrefillSegment, out: torch.Tensor) -> None:
    """A prefill chunk: causal over itself, or over its cached prefix (gathered from the pool) too."""
    s, n, dev, window = seg.start, seg.length, q.device, spec.window
    qs = q[s : s + n].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
    if seg.bidir is not None:  # an image's tokens see each other both ways (within the window)
        p0 = seg.prefix_len
        if p0 == 0:
            ks, vs = k[s : s + n], v[s : s + n]
        else:
            assert seg.kv_slots is not None
            ks, vs = pool.gather(layer, seg.kv_slots)
        q_pos, k_pos = torch.arange(p0, p0 + n, device=dev), torch.arange(p0 + n, device=dev)
        mask = window_mask(q_pos, k_pos, None) | seg.bidir
        if window is not None:
            mask &= k_pos.unsqueeze(0) > q_pos.unsqueeze(1) - window
        o = sdpa(qs, ks.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0), mask, spec.scale,
                 spec.softcap, sinks=spec.sinks)
        out[s : s + n] = o.squeeze(0).transpose(0, 1)
        return
    if seg.prefix_len == 0:
        ks = k[s : s + n].transpose(0, 1).unsqueeze(0)
        vs = v[s : s + n].transpose(0, 1).unsqueeze(0)
        if window is None or n <= window:
            o = sdpa(qs, ks, vs, None, spec.scale, spec.softcap, causal=True, sinks=spec.sinks)
        else:
            p = torch.arange(n, device=dev)
            o = sdpa(qs, ks, vs, window_mask(p, p, window), spec.scale, spec.softcap, sinks=spec.sinks)
    else:
        assert seg.kv_slots is not None
        ks, vs = pool.gather(layer, seg.kv_slots)
        ks, vs = ks.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0)
        mask = seg.mask
        if window is not None:
            mask = window_mask(torch.arange(seg.prefix_len, seg.prefix_len + n, device=dev),
                               torch.arange(seg.prefix_len + n, device=dev), window)
        o = sdpa(qs, ks, vs, mask, spec.scale, spec.softcap, sinks=spec.sinks)
    out[s : s + n] = o.squeeze(0).transpose(0, 1)


def _all_true(width: int, device: torch.device) -> torch.Tensor:
    # A lone decode passes an all-True mask; pass one too, so SDPA takes the same path.
    return torch.ones(1, 1, 1, width, dtype=torch.bool, device=device)
