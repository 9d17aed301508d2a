"""Rotary position embeddings, with the scaling variants that HF configs name.

The cos/sin tables are computed once in float32 for every position up to the context length;
a forward pass indexes them by position, so a flat batch of tokens from many requests at
different positions is handled by one gather.
"""

from __future__ import annotations

import math
from typing import Any

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "freq_factors")


def rope_inv_freq(
    head_dim: int, theta: float, scaling: dict[str, Any] | None, max_position: int
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (float32, ``[head_dim // 2]``) and the attention scaling factor."""
    base = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return base, 1.0
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return base, 1.0
    if kind == "linear":
        return base / float(scaling["factor"]), 1.0
    if kind == "dynamic":
        # Dynamic NTK only changes frequencies past the original context; within it, it is the
        # default rope. Positions past it are refused by the engine's context limit.
        return base, 1.0
    if kind == "freq_factors":  # GGUF's rope_freqs tensor: each frequency divided by its factor
        factors = torch.tensor(scaling["factors"], dtype=torch.float32)
        if factors.shape != base.shape:
            raise ValueError(f"rope_freqs has {factors.numel()} entries, expected {base.numel()}")
        return base / factors, 1.0
    if kind == "llama3":
        return _llama3(base, scaling), 1.0
    if kind == "yarn":
        return _yarn(head_dim, theta, scaling, max_position)
    raise ValueError(
        f"rope scaling type {kind!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
    )


def _llama3(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    factor = float(s["factor"])
    low = float(s.get("low_freq_factor", 1.0))
    high = float(s.get("high_freq_factor", 4.0))
    old_ctx = float(s.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths (low frequencies) are interpolated by `factor`, short ones kept, and the
    # band in between blended linearly in 1/wavelength.
    smooth = (old_ctx / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(medium, blended, out)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(
    dim: int, theta: float, s: dict[str, Any], max_position: int
) -> tuple[torch.Tensor, float]:
    factor = float(s["factor"])
    orig = int(s.get("original_max_position_embeddings") or max_position)
    beta_fast = float(s.get("beta_fast") or 32)
    beta_slow = float(s.get("beta_slow") or 1)
    attn = s.get("attention_factor")
    mscale, mscale_all = s.get("mscale"), s.get("mscale_all_dim")
    if attn is None:
        if mscale and mscale_all:
            attn = _yarn_mscale(factor, float(mscale)) / _yarn_mscale(factor, float(mscale_all))
        else:
            attn = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        # The dimension whose wavelength completes `rotations` turns over the original context.
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    lo, hi = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolate = 1.0 / pos_freqs
    interpolate = 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # 1: keep the original frequency (high-frequency dims)
    return interpolate * (1 - keep) + extrapolate * keep, float(attn)


class RotaryEmbedding:
    """Precomputed cos/sin tables; ``apply`` rotates q and k in the HF half-split layout."""

    def __init__(
        self,
        head_dim: int,
        theta: float,
        scaling: dict[str, Any] | None,
        max_position: int,
        device: torch.device,
    ) -> None:
        inv_freq, attn_scale = rope_inv_freq(head_dim, theta, scaling, max_position)
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * attn_scale).to(device)
        self.sin = (emb.sin() * attn_scale).to(device)
        self.max_position = max_position

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for each position: ``[T, 1, head_dim]`` in ``dtype`` (once per forward)."""
        return (
            self.cos.index_select(0, positions).to(dtype).unsqueeze(1),
            self.sin.index_select(0, positions).to(dtype).unsqueeze(1),
        )


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, heads, head_dim]`` by the per-token angles."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin
