"""What the Mamba2 hybrids (Nemotron-H, Granite 4.0) share: an explicit per-sequence cache, the
attention of their few attention layers over it, and the decoder shell (embedding, layers, final
norm, LM head) with a prefill / token-by-token forward.

This is the models' math with the simplest cache that serves one sequence: ``HybridCache`` holds,
per layer, either the Mamba2 state (``layers/mamba2.py``: conv window ``[1, conv_dim, K-1]`` and
ssm state ``[1, H, P, N]``, float32) or the attention layer's K/V ``[T, KVH, D]``. ``forward(ids,
cache)`` runs any number of new tokens after what the cache holds (a whole prompt, a chunk of it,
or one decode token) and returns their logits; ``greedy`` is the loop a test drives. The engine
integration (state pool, paged KV) will call the same layers with its own storage.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tripod.layers.attention import sdpa, window_mask
from tripod.layers.batch import Backend
from tripod.layers.linear import Linear
from tripod.layers.mamba2 import Mamba2Config, Mamba2Mixer, new_state
from tripod.layers.norm import rms_norm
from tripod.layers.rotary import RotaryEmbedding, apply_rotary
from tripod.layers.short_conv import ShortConv, new_conv_state
from tripod.layers.weights import WeightSource
from tripod.models.gqa import new_param


@dataclass(slots=True)
class HybridCache:
    """One sequence's cache: per Mamba2 layer its (conv, ssm) state, per attention layer its K/V;
    ``length``: the tokens it has seen (the next token's position)."""

    states: dict[int, tuple[torch.Tensor, ...]] = field(default_factory=dict)
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    length: int = 0

    def state(self, layer: int, cfg: Mamba2Config, device: torch.device) -> tuple[torch.Tensor, ...]:
        """A Mamba2 layer's (conv ``[1, conv_dim, K-1]``, ssm ``[1, H, P, N]``)."""
        if layer not in self.states:
            self.states[layer] = new_state(cfg, 1, device)
        return self.states[layer]

    def window(self, layer: int, conv: ShortConv, device: torch.device) -> torch.Tensor:
        """A short-conv layer's window ``[1, hidden, L-1]``."""
        if layer not in self.states:
            self.states[layer] = (new_conv_state(conv.hidden, conv.kernel, 1, device),)
        return self.states[layer][0]


@dataclass(frozen=True, slots=True)
class AttnShape:
    """An attention layer's heads, scale and options."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    scale: float
    bias: bool = False
    qk_norm_eps: float | None = None  # per-head RMSNorm of q and k (LFM2), before RoPE
    o_name: str = "o_proj"


class CachedAttention(nn.Module):
    """Grouped-query attention with fused Q/K/V over a ``HybridCache`` (no RoPE when ``rotary`` is None)."""

    def __init__(self, shape: AttnShape, dtype: torch.dtype) -> None:
        super().__init__()
        s = shape
        self.shape = s
        self.q_size, self.kv_size = s.heads * s.head_dim, s.kv_heads * s.head_dim
        self.qkv = new_param(self.q_size + 2 * self.kv_size, s.hidden, dtype=dtype)
        self.qkv_bias = new_param(self.q_size + 2 * self.kv_size, dtype=dtype, fill=0.0) if s.bias else None
        self.o = new_param(s.hidden, self.q_size, dtype=dtype)
        self.o_bias = new_param(s.hidden, dtype=dtype, fill=0.0) if s.bias else None
        qk = s.qk_norm_eps is not None
        self.q_norm = new_param(s.head_dim, dtype=dtype, fill=1.0) if qk else None
        self.k_norm = new_param(s.head_dim, dtype=dtype, fill=1.0) if qk else None
        self.ops: dict[str, tuple[Linear, Linear]] = {}

    def load(self, src: WeightSource, a: str, qk_norms: tuple[str, str] = ("q_norm", "k_norm")) -> None:
        names = [a + "q_proj.", a + "k_proj.", a + "v_proj."]
        o = a + self.shape.o_name
        self.qkv.data = torch.cat([src.get(n + "weight") for n in names]).contiguous()
        self.o.data = src.get(o + ".weight").contiguous()
        if self.qkv_bias is not None and self.o_bias is not None:
            self.qkv_bias.data = torch.cat([src.get(n + "bias") for n in names])
            self.o_bias.data = src.get(o + ".bias")
        if self.q_norm is not None and self.k_norm is not None:
            self.q_norm.data = src.get(f"{a}{qk_norms[0]}.weight")
            self.k_norm.data = src.get(f"{a}{qk_norms[1]}.weight")

    def prepare(self, backend: Backend) -> None:
        if backend.form not in self.ops:
            self.ops[backend.form] = (backend.linear(self.qkv, self.qkv_bias), backend.linear(self.o, self.o_bias))

    def forward(self, h: torch.Tensor, backend: Backend, cache: HybridCache, layer: int,
                rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """``h`` ``[n, hidden]``, the tokens after ``cache.length``; their K/V join the cache."""
        s, n = self.shape, h.shape[0]
        qkv_op, o_op = self.ops[backend.form]
        q, k, v = qkv_op(h).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k, v = q.view(n, s.heads, s.head_dim), k.view(n, s.kv_heads, s.head_dim), v.view(n, s.kv_heads, s.head_dim)
        if self.q_norm is not None and self.k_norm is not None and s.qk_norm_eps is not None:
            q, k = rms_norm(q, self.q_norm, s.qk_norm_eps), rms_norm(k, self.k_norm, s.qk_norm_eps)
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        if layer in cache.kv:
            k0, v0 = cache.kv[layer]
            k, v = torch.cat((k0, k)), torch.cat((v0, v))
        cache.kv[layer] = (k, v)
        p0 = cache.length
        mask = window_mask(torch.arange(p0, p0 + n), torch.arange(p0 + n), None)
        o = sdpa(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
                 mask, s.scale)
        return o_op(o.squeeze(0).transpose(0, 1).reshape(n, self.q_size))


class HybridLayer(nn.Module):
    """A layer's mixer (Mamba2, short conv or attention) reached through one call, whatever its kind."""

    def __init__(self, index: int, mixer: Mamba2Mixer | CachedAttention | ShortConv | None) -> None:
        super().__init__()
        self.index = index
        self.mixer = mixer

    def mix(self, h: torch.Tensor, backend: Backend, cache: HybridCache,
            rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        m = self.mixer
        if isinstance(m, Mamba2Mixer):
            conv, ssm = cache.state(self.index, m.cfg, h.device)
            return m(h, backend, conv, ssm, [h.shape[0]])
        if isinstance(m, ShortConv):
            return m(h, backend, cache.window(self.index, m, h.device), [h.shape[0]])
        assert isinstance(m, CachedAttention)
        return m(h, backend, cache, self.index, rope)

    def prepare(self, backend: Backend) -> None:
        if self.mixer is not None:
            self.mixer.prepare(backend)

    def forward(self, x: torch.Tensor, backend: Backend, cache: HybridCache,
                rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        raise NotImplementedError


class HybridForCausalLM(nn.Module):
    """Embedding, layers, final norm and LM head; ``forward`` over a ``HybridCache``. A family
    sets its layers, names and multipliers (``embed_scale``, ``logits_div``)."""

    embed_name = "model.embed_tokens.weight"
    norm_name = "model.norm.weight"

    def __init__(self, vocab: int, hidden: int, eps: float, tie: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype, self.eps = dtype, eps
        self.embed = new_param(vocab, hidden, dtype=dtype)
        self.norm = new_param(hidden, dtype=dtype, fill=1.0)
        self.lm_head = None if tie else new_param(vocab, hidden, dtype=dtype)
        self.layers = nn.ModuleList()
        self.rotary: RotaryEmbedding | None = None
        self.embed_scale = 1.0
        self.logits_div = 1.0
        self.backend: Backend | None = None
        self.head: Linear | None = None

    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        src = WeightSource(weights, self.dtype, torch.device("cpu"))
        self.embed.data = src.get(self.embed_name).contiguous()
        self.norm.data = src.get(self.norm_name)
        if self.lm_head is not None:
            self.lm_head.data = src.get("lm_head.weight").contiguous() if src.has("lm_head.weight") else self.embed.data
        for layer in self.layers:
            self.load_layer(layer, src)

    def load_layer(self, layer: Any, src: WeightSource) -> None:
        raise NotImplementedError

    def prepare(self, backend: Backend) -> None:
        """Build every projection for ``backend`` (the reference backend: F.linear, op for op with HF)."""
        for layer in self.layers:
            layer.prepare(backend)
        self.head = backend.linear(self.embed if self.lm_head is None else self.lm_head, None)
        self.backend = backend

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, cache: HybridCache) -> torch.Tensor:
        """``ids`` ``[n]``: the tokens after ``cache.length``; returns their logits ``[n, vocab]``
        (float32) and advances the cache."""
        if self.backend is None or self.head is None:
            raise ValueError("call prepare(backend) before forward")
        n = ids.shape[0]
        x = F.embedding(ids, self.embed)
        if self.embed_scale != 1.0:
            x = x * self.embed_scale
        rope = None
        if self.rotary is not None:
            rope = self.rotary.tables(torch.arange(cache.length, cache.length + n), self.dtype)
        for layer in self.layers:
            x = layer(x, self.backend, cache, rope)
        cache.length += n
        logits = self.head(rms_norm(x, self.norm, self.eps)).float()
        return logits / self.logits_div if self.logits_div != 1.0 else logits

    def greedy(self, prompt: list[int], max_new: int, chunk: int | None = None) -> list[int]:
        """Greedy decoding: the prompt (in chunks of ``chunk`` tokens, or whole), then one token at
        a time; returns the new tokens."""
        cache = HybridCache()
        ids = torch.tensor(prompt, dtype=torch.long)
        step = chunk or len(prompt)
        for i in range(0, len(prompt), step):
            logits = self(ids[i : i + step], cache)
        out: list[int] = []
        for _ in range(max_new):
            tok = int(logits[-1].argmax())
            out.append(tok)
            logits = self(torch.tensor([tok]), cache)
        return out


def mamba_config(d: Mapping[str, Any], **names: str) -> Mamba2Config:
    """A family's Mamba2 geometry from its HF config dict; ``names`` maps each field to the key
    that family uses for it."""
    get = {f: d[k] for f, k in names.items() if k in d}
    limit = d.get("time_step_limit") or (0.0, float("inf"))
    return Mamba2Config(dt_limit=(float(limit[0]), float(limit[1])), **get)
