"""Paged (page size 1) attention over the KV pool, for a flat batch of mixed work.

Two backends behind one call (``attend``), picked per step by the model runner:

- kernels (CPU with tripod's C++ kernels; ``ForwardBatch.kernel`` set): RoPE and the KV write in
  one pass, then every query row attends its own keys straight from the pool through the slot
  table (``tripod.kernels``: decode rows, verification rows and prefill chunks alike).
- torch (CUDA, the float32 reference path, or before/without the kernels): a step's tokens are
  laid out flat: first one token per decoding request, then each prefill chunk's tokens. Decodes
  attend in one padded, batched SDPA call (over the dense decode mirror, or gathered); each
  prefill chunk attends to its cached prefix plus itself with a causal mask.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from tripod.layers.rotary import RotaryEmbedding, apply_rotary
from tripod.memory.kv_pool import KVPool


@dataclass(slots=True)
class PrefillSegment:
    start: int  # first token of the chunk in the flat batch
    length: int  # tokens in the chunk
    prefix_len: int  # tokens before the chunk whose KV is already in the pool
    kv_slots: torch.Tensor | None  # [prefix_len + length] slots; None when prefix_len == 0
    mask: torch.Tensor | None  # [length, prefix_len + length] bool; None when prefix_len == 0


@dataclass(slots=True)
class KernelMeta:
    """What the C++ attention needs: query ``t`` attends ``table[rows[t], :lens[t]]``."""

    table: torch.Tensor  # [requests, width] int32 slot ids (memory.SlotTable)
    rows: torch.Tensor  # [T] int32
    lens: torch.Tensor  # [T] int32: position + 1


@dataclass(slots=True)
class ForwardBatch:
    """Everything a forward pass needs, as tensors on the model's device."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    out_slots: torch.Tensor  # [T] KV slot each token's K/V is written to
    num_decode: int  # the first num_decode tokens are single-token decodes
    decode_kv_idx: torch.Tensor | None  # [num_decode, L] slots, padded
    decode_mask: torch.Tensor | None  # [num_decode, 1, 1, L] bool, True = attend
    prefills: list[PrefillSegment] = field(default_factory=list)
    # [layers, rows, len, 2, KVH, D]: decode rows in batch order (see DecodeMirror); when set,
    # decodes read it instead of gathering decode_kv_idx from the pool.
    decode_mirror: torch.Tensor | None = None
    logits_idx: torch.Tensor | None = None  # [S] flat positions whose logits are wanted
    # Jump-forward verification, right after the decodes: (flat start, first position, rows,
    # KV slots [first position + rows]). Each row is one query position attending exactly like
    # a lone decode at that position (same width, same kernel), so its numerics are those of
    # plain decoding: SDPA's result depends on how far the keys are padded.
    verifies: list[tuple[int, int, int, torch.Tensor]] = field(default_factory=list)
    # Set when this step runs on tripod's CPU kernels (then the torch-path fields are unused).
    kernel: KernelMeta | None = None
    kernel_ops: Any = None  # torch.ops.tripod_cpu, when ``kernel`` is set
    form: str = "dense"  # which executable form of the projections runs (layers.linear.Form)


def attend(
    qkv: torch.Tensor,
    layer: int,
    pool: KVPool,
    batch: ForwardBatch,
    rotary: RotaryEmbedding,
    cos_sin: tuple[torch.Tensor, torch.Tensor] | None,
    num_heads: int,
    num_kv_heads: int,
    scale: float,
) -> torch.Tensor:
    """The attention block after the QKV projection: rotate Q/K, write this step's K/V into
    the pool, attend. ``qkv`` ``[T, (H + 2 KVH) * D]`` → ``[T, H * D]``."""
    t = qkv.shape[0]
    d = pool.head_dim
    if batch.kernel is not None:
        ops = batch.kernel_ops
        m = batch.kernel
        kv = pool.kv[layer]
        # NOTE: rotates Q and K inside qkv, in place, and copies K|V into the pool slots.
        ops.rope_store_kv(qkv, batch.positions, rotary.cos, rotary.sin, kv, batch.out_slots, num_heads, num_kv_heads)
        q = qkv.view(t, -1, d)[:, :num_heads]
        return ops.paged_attention(q, kv, m.table, m.rows, m.lens, scale).view(t, num_heads * d)
    assert cos_sin is not None
    heads = qkv.reshape(t, -1, d)
    # Q and K heads are adjacent in the fused output: rotate them in one pass.
    qk = apply_rotary(heads[:, : num_heads + num_kv_heads], *cos_sin)
    q, k = qk[:, :num_heads], qk[:, num_heads:]
    v = heads[:, num_heads + num_kv_heads :]
    return paged_attention(q, k, v, layer, pool, batch, scale).view(t, num_heads * d)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer: int,
    pool: KVPool,
    batch: ForwardBatch,
    scale: float,
) -> torch.Tensor:
    """q ``[T, H, D]``, k/v ``[T, KVH, D]`` (already rotated) → ``[T, H, D]``.

    Writes this step's K/V into the pool first, so decodes read their own token from it.
    """
    pool.write(layer, batch.out_slots, k, v)
    out = torch.empty_like(q)
    nd = batch.num_decode
    if nd:
        assert batch.decode_mask is not None
        width = batch.decode_mask.shape[-1]
        if batch.decode_mirror is not None:
            rows = batch.decode_mirror[layer]
            rows[torch.arange(nd, device=q.device), batch.positions[:nd]] = torch.stack(
                (k[:nd], v[:nd]), dim=1
            )
            dense = rows[:nd, :width]  # [B, L, 2, KVH, D]
            kc, vc = dense.select(2, 0), dense.select(2, 1)
        else:
            assert batch.decode_kv_idx is not None
            kc, vc = pool.gather(layer, batch.decode_kv_idx)  # [B, L, KVH, D] each
        kc, vc = kc.transpose(1, 2), vc.transpose(1, 2)
        o = F.scaled_dot_product_attention(
            q[:nd].unsqueeze(2), kc, vc, attn_mask=batch.decode_mask, scale=scale, enable_gqa=True
        )
        out[:nd] = o.squeeze(2)
    for s0, p0, n, kv in batch.verifies:
        kc, vc = pool.gather(layer, kv)  # [p0 + n, KVH, D] each
        kc, vc = kc.unsqueeze(0).transpose(1, 2), vc.unsqueeze(0).transpose(1, 2)
        for j in range(n):
            w = p0 + j + 1
            o = F.scaled_dot_product_attention(
                q[s0 + j : s0 + j + 1].unsqueeze(2), kc[:, :, :w], vc[:, :, :w],
                attn_mask=_all_true(w, q.device), scale=scale, enable_gqa=True,
            )
            out[s0 + j] = o[0, :, 0]
    for seg in batch.prefills:
        s, n = seg.start, seg.length
        qs = q[s : s + n].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if seg.prefix_len == 0:
            ks = k[s : s + n].transpose(0, 1).unsqueeze(0)
            vs = v[s : s + n].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
        else:
            assert seg.kv_slots is not None
            ks, vs = pool.gather(layer, seg.kv_slots)
            ks, vs = ks.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(
                qs, ks, vs, attn_mask=seg.mask, scale=scale, enable_gqa=True
            )
        out[s : s + n] = o.squeeze(0).transpose(0, 1)
    return out


def _all_true(width: int, device: torch.device) -> torch.Tensor:
    # A lone decode passes an all-True mask; pass one too, so SDPA takes the same path.
    return torch.ones(1, 1, 1, width, dtype=torch.bool, device=device)
