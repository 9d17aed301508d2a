"""Plain-torch definitions of what each CPU kernel computes: the self-check after a build and
the unit tests compare the kernels with these."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def paged_attention(
    q: torch.Tensor, kv: torch.Tensor, table: torch.Tensor, rows: torch.Tensor, lens: torch.Tensor, scale: float
) -> torch.Tensor:
    """Query row ``t`` (``[H, D]``) attends the K/V of slots ``table[rows[t], :lens[t]]`` in ``kv``
    (``[slots, 2, KVH, D]``); query head ``h`` uses KV head ``h // (H // KVH)``. float32 math."""
    nt, heads, _d = q.shape
    group = heads // kv.shape[2]
    out = torch.empty(q.shape, dtype=torch.float32)
    for t in range(nt):
        slots = table[int(rows[t]), : int(lens[t])].long()
        k = kv[slots, 0].float().repeat_interleave(group, dim=1)  # [L, H, D]
        v = kv[slots, 1].float().repeat_interleave(group, dim=1)
        s = torch.einsum("hd,lhd->hl", q[t].float(), k) * scale
        out[t] = torch.einsum("hl,lhd->hd", torch.softmax(s, dim=-1), v)
    return out.to(q.dtype)


def rope_store_kv(
    qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    kv: torch.Tensor, slots: torch.Tensor, num_heads: int, num_kv_heads: int,
) -> None:
    """Rotate Q and K heads of ``qkv`` in place (HF half-split layout, float32 math) and write
    this step's K and V rows into ``kv[slots]``."""
    d = kv.shape[-1]
    nt = qkv.shape[0]
    heads = qkv.view(nt, -1, d)
    x = heads[:, : num_heads + num_kv_heads].float()
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    half = d // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    heads[:, : num_heads + num_kv_heads] = (x * c + rotated * s).to(qkv.dtype)
    kv[slots] = heads[:, num_heads:].reshape(nt, 2, num_kv_heads, d)


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    g, u = gu.float().chunk(2, dim=-1)
    return (F.silu(g) * u).to(gu.dtype)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)
