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


def conv_update(x: torch.Tensor, window: torch.Tensor, items: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
    """The causal depthwise conv + SiLU of each item ``(first, n, slot, _)`` of ``items`` over its
    rows of ``x`` ``[T, C]``, continuing ``window[slot]`` ``[C, K - 1]`` (updated). float32 math."""
    out = torch.empty(x.shape, dtype=torch.float32)
    k = weight.shape[1]
    for first, n, slot, _ in items.tolist():
        seq = torch.cat((window[slot].t(), x[first : first + n].float()))  # [K - 1 + n, C]
        acc = sum(seq[j : j + n] * weight[:, j] for j in range(k))
        acc = acc + bias if bias is not None else acc
        out[first : first + n] = acc / (1.0 + torch.exp(-acc))
        window[slot] = seq[n:].t()
    return out


def gated_delta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor,
                state: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
    """The gated delta rule per item over ``state[slot]`` ``[HV, DK, DV]`` (updated); value head ``h``
    reads key head ``h // (HV / HK)``."""
    rep = v.shape[1] // q.shape[1]
    q, k = q.repeat_interleave(rep, 1), k.repeat_interleave(rep, 1)
    out = torch.empty(v.shape, dtype=torch.float32)
    for first, n, slot, _ in items.tolist():
        s = state[slot]
        for r in range(first, first + n):
            s = s * decay[r][:, None, None]
            kv = (s * k[r][:, :, None]).sum(1)
            s = s + k[r][:, :, None] * ((v[r] - kv) * beta[r][:, None])[:, None, :]
            out[r] = (s * q[r][:, :, None]).sum(1)
        state[slot] = s
    return out


def ssd_scan(x: torch.Tensor, b: torch.Tensor, c: torch.Tensor, dt: torch.Tensor, decay: torch.Tensor,
             state: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
    """Mamba2's recurrence per item over ``state[slot]`` ``[H, P, N]`` (updated): ``x`` ``[T, H * P]``,
    ``b``/``c`` ``[T, G * N]`` (head ``h`` reads group ``h // (H / G)``), ``dt``/``decay`` ``[T, H]``."""
    t = x.shape[0]
    _, h, p, n = state.shape
    rep = h // (b.shape[1] // n)
    xs = x.reshape(t, h, p)
    bs, cs = (m.reshape(t, -1, n).repeat_interleave(rep, 1) for m in (b, c))
    y = torch.empty(t, h, p)
    for first, count, slot, _ in items.tolist():
        s = state[slot]
        for r in range(first, first + count):
            s = s * decay[r][:, None, None] + (dt[r][:, None] * bs[r])[:, None, :] * xs[r][:, :, None]
            y[r] = (s * cs[r][:, None, :]).sum(-1)
        state[slot] = s
    return y
