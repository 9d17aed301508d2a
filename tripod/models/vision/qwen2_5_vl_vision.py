"""Qwen2.5-VL's vision tower: dynamic resolution, windowed attention with full-attention blocks,
2-D RoPE, and the patch merger.

An image arrives as its processor's patch rows (``[t*h*w, C*T*p*p]``, in merge-block order: each
``m × m`` block of patches consecutive) and its grid ``(t, h, w)``. The patches are embedded (the
3-D convolution as one matmul), reordered window by window (a window is ``window_size`` pixels
square, i.e. ``window_size / patch / m`` merged units a side, ragged at the right and bottom
edges), and run through the blocks: most attend within their window, the ``fullatt_block_indexes``
ones over the whole image. Every attention is bidirectional. RoPE rotates by the patch's (row,
column), half the rotary frequencies each. The merger RMS-normalises, concatenates each ``m × m``
block and projects it to the decoder's width (``[t*h*w / m², out_hidden]``), back in the image's order.
Several images (of one or many requests) go through in one pass: their patches are concatenated
and no attention crosses an image.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tripod.layers.weights import WeightSource
from tripod.models.vision.vit import LinearParams, activation, frozen


def vision_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Qwen2.5-VL's RMSNorm (float32 inside, ``weight`` applied after the cast back)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def window_order(grids: list[list[int]], merge: int, window: int) -> tuple[list[int], list[int]]:
    """The merged units of ``grids`` reordered window by window (indices into the units in image
    order), and every window's end in patch rows (cumulative; windows of zero units dropped)."""
    order: list[int] = []
    ends: list[int] = []
    base = 0
    unit = merge * merge
    for t, h, w in grids:
        gh, gw = h // merge, w // merge
        for f in range(t):
            for wy in range(0, gh, window):
                for wx in range(0, gw, window):
                    cells = [base + (f * gh + y) * gw + x
                             for y in range(wy, min(wy + window, gh)) for x in range(wx, min(wx + window, gw))]
                    order += cells
                    ends.append((ends[-1] if ends else 0) + len(cells) * unit)
        base += t * gh * gw
    return order, ends


def patch_positions(grids: list[list[int]], merge: int) -> torch.Tensor:
    """``[patches, 2]`` (row, column) of every patch, in the processor's merge-block order."""
    out = []
    for t, h, w in grids:
        rows = torch.arange(h).unsqueeze(1).expand(h, w)
        cols = torch.arange(w).unsqueeze(0).expand(h, w)
        block = (h // merge, merge, w // merge, merge)
        pos = torch.stack([rows.reshape(block).transpose(1, 2).flatten(), cols.reshape(block).transpose(1, 2).flatten()], 1)
        out.append(pos.repeat(t, 1))
    return torch.cat(out)


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ends: list[int], scale: float) -> torch.Tensor:
    """Bidirectional attention within each segment ``[ends[i-1], ends[i])`` of ``q/k/v``
    ``[N, heads, D]``; segments of one length run as one batched call."""
    out = torch.empty_like(q)
    starts = [0, *ends[:-1]]
    by_len: dict[int, list[int]] = {}
    for s, e in zip(starts, ends, strict=True):
        by_len.setdefault(e - s, []).append(s)
    for n, firsts in by_len.items():
        idx = (torch.tensor(firsts).unsqueeze(1) + torch.arange(n)).flatten().to(q.device)
        qs, ks, vs = (x.index_select(0, idx).view(len(firsts), n, *x.shape[1:]).transpose(1, 2) for x in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks, vs, scale=scale)
        out.index_copy_(0, idx, o.transpose(1, 2).reshape(len(firsts) * n, *q.shape[1:]))
    return out


class QwenVisionBlock(nn.Module):
    """RMSNorm → attention (fused QKV with bias, 2-D RoPE) → residual; RMSNorm → gated MLP → residual."""

    def __init__(self, cfg: dict[str, Any], dtype: torch.dtype) -> None:
        super().__init__()
        h, inter = int(cfg["hidden_size"]), int(cfg["intermediate_size"])
        self.heads = int(cfg["num_heads"])
        self.scale = (h // self.heads) ** -0.5
        self.norm1, self.norm2 = frozen(h, dtype=dtype), frozen(h, dtype=dtype)
        self.qkv, self.proj = LinearParams(3 * h, h, dtype), LinearParams(h, h, dtype)
        self.gate, self.up, self.down = LinearParams(inter, h, dtype), LinearParams(inter, h, dtype), LinearParams(h, inter, dtype)
        self.act = activation(str(cfg.get("hidden_act", "silu")))

    def load(self, src: WeightSource, p: str) -> None:
        self.norm1.data, self.norm2.data = src.get(p + "norm1.weight"), src.get(p + "norm2.weight")
        self.qkv.load(src, p + "attn.qkv")
        self.proj.load(src, p + "attn.proj")
        for part, name in ((self.gate, "gate_proj"), (self.up, "up_proj"), (self.down, "down_proj")):
            part.load(src, p + "mlp." + name)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ends: list[int]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(vision_rms_norm(x, self.norm1)).view(n, 3, self.heads, -1).unbind(1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        a = segment_attention(q, k, v, ends, self.scale)
        x = x + self.proj(a.reshape(n, -1))
        y = vision_rms_norm(x, self.norm2)
        return x + self.down(self.act(self.gate(y)) * self.up(y))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in float32 (half-split layout), back to ``x``'s dtype; ``cos/sin`` ``[N, D]``."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)).to(x.dtype)


class QwenVisionTower(nn.Module):
    """Images' patch rows and grids → merged features ``[Σ t*h*w / m², out_hidden]`` (image order)."""

    def __init__(self, cfg: dict[str, Any], dtype: torch.dtype) -> None:
        super().__init__()
        h = int(cfg["hidden_size"])
        self.patch, self.merge = int(cfg.get("patch_size", 14)), int(cfg.get("spatial_merge_size", 2))
        self.temporal = int(cfg.get("temporal_patch_size", 2))
        self.channels = int(cfg.get("in_channels", 3))
        self.window = int(cfg.get("window_size", 112)) // self.merge // self.patch
        self.full = set(int(i) for i in cfg.get("fullatt_block_indexes", ()))
        head_dim = h // int(cfg["num_heads"])
        theta = float((cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        half = head_dim // 2
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, half, 2, dtype=torch.float) / half))
        self.patch_weight = frozen(h, self.patch_dim, dtype=dtype)
        self.blocks = nn.ModuleList(QwenVisionBlock(cfg, dtype) for _ in range(int(cfg["depth"])))
        unit = h * self.merge * self.merge
        self.merger_norm = frozen(h, dtype=dtype)
        self.merger_in = LinearParams(unit, unit, dtype)
        self.merger_out = LinearParams(int(cfg["out_hidden_size"]), unit, dtype)

    @property
    def patch_dim(self) -> int:
        return self.channels * self.temporal * self.patch * self.patch

    def load(self, src: WeightSource, p: str) -> None:
        self.patch_weight.data = src.get(p + "patch_embed.proj.weight").reshape(self.patch_weight.shape).contiguous()
        for i, block in enumerate(self.blocks):
            block.load(src, f"{p}blocks.{i}.")
        self.merger_norm.data = src.get(p + "merger.ln_q.weight")
        self.merger_in.load(src, p + "merger.mlp.0")
        self.merger_out.load(src, p + "merger.mlp.2")

    def forward(self, pixels: torch.Tensor, grids: list[list[int]]) -> torch.Tensor:
        unit = self.merge * self.merge
        x = F.linear(pixels.to(self.patch_weight.dtype), self.patch_weight)
        order, window_ends = window_order(grids, self.merge, self.window)
        image_ends = torch.tensor([t * h * w for t, h, w in grids]).cumsum(0).tolist()
        perm = (torch.tensor(order).unsqueeze(1) * unit + torch.arange(unit)).flatten().to(x.device)
        freqs = patch_positions(grids, self.merge).float().unsqueeze(-1) * self.inv_freq  # [N, 2, D/4]
        angles = freqs.flatten(1).to(x.device)
        angles = torch.cat((angles, angles), dim=-1).index_select(0, perm)
        cos, sin = angles.cos(), angles.sin()
        x = x.index_select(0, perm)
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, image_ends if i in self.full else window_ends)
        x = vision_rms_norm(x, self.merger_norm).view(-1, self.merger_in.weight.shape[1])
        x = self.merger_out(F.gelu(self.merger_in(x)))
        return x.index_select(0, torch.tensor(order).argsort().to(x.device))
