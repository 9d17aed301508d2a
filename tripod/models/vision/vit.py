"""The pre-norm ViT encoder CLIP's and SigLIP's vision towers share, in torch's ops.

A layer is LayerNorm → multi-head self-attention (Q/K/V/out with biases, no mask: every patch sees
every patch of its image) → residual, LayerNorm → fc1 → activation → fc2 → residual: transformers'
``CLIPEncoderLayer`` / ``SiglipEncoderLayer`` op for op, so float32 features match. The towers run
in the engine's dtype (bfloat16 on the optimized path), once per image (``engine/vision.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tripod.layers.weights import WeightSource


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """transformers' ``ACT2FN[name]`` for the activations vision towers and projectors use."""
    if name == "quick_gelu":
        return lambda x: x * torch.sigmoid(1.702 * x)
    if name == "gelu":
        return F.gelu
    if name in ("gelu_pytorch_tanh", "gelu_new", "gelu_tanh"):
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "silu":
        return F.silu
    raise ValueError(f"vision activation {name!r} is not supported; supported: quick_gelu, gelu, gelu_pytorch_tanh, silu")


def frozen(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class LinearParams(nn.Module):
    """A projection's weight and bias, loaded by HF name and applied with ``F.linear``."""

    def __init__(self, out_f: int, in_f: int, dtype: torch.dtype, bias: bool = True) -> None:
        super().__init__()
        self.weight = frozen(out_f, in_f, dtype=dtype)
        self.bias = frozen(out_f, dtype=dtype) if bias else None

    def load(self, src: WeightSource, name: str) -> None:
        self.weight.data = src.get(name + ".weight").contiguous()
        if self.bias is not None:
            self.bias.data = src.get(name + ".bias")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class LayerNormParams(nn.Module):
    """LayerNorm's weight and bias (``F.layer_norm``)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = frozen(dim, dtype=dtype)
        self.bias = frozen(dim, dtype=dtype)

    def load(self, src: WeightSource, name: str) -> None:
        self.weight.data = src.get(name + ".weight")
        self.bias.data = src.get(name + ".bias")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


class VitLayer(nn.Module):
    """One pre-norm encoder layer (``encoder.layers.N.*`` in transformers' names)."""

    def __init__(self, cfg: dict[str, Any], dtype: torch.dtype) -> None:
        super().__init__()
        h, inter = int(cfg["hidden_size"]), int(cfg["intermediate_size"])
        eps = float(cfg.get("layer_norm_eps", 1e-6))
        self.heads = int(cfg["num_attention_heads"])
        self.scale = (h // self.heads) ** -0.5
        self.norm1, self.norm2 = LayerNormParams(h, eps, dtype), LayerNormParams(h, eps, dtype)
        self.q, self.k, self.v, self.out = (LinearParams(h, h, dtype) for _ in range(4))
        self.fc1, self.fc2 = LinearParams(inter, h, dtype), LinearParams(h, inter, dtype)
        self.act = activation(str(cfg.get("hidden_act", "quick_gelu")))

    def load(self, src: WeightSource, p: str) -> None:
        self.norm1.load(src, p + "layer_norm1")
        self.norm2.load(src, p + "layer_norm2")
        for part, name in ((self.q, "q_proj"), (self.k, "k_proj"), (self.v, "v_proj"), (self.out, "out_proj")):
            part.load(src, p + "self_attn." + name)
        self.fc1.load(src, p + "mlp.fc1")
        self.fc2.load(src, p + "mlp.fc2")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        y = self.norm1(x)
        q, k, v = (part(y).view(b, s, self.heads, -1).transpose(1, 2) for part in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, scale=self.scale)
        x = x + self.out(a.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(self.act(self.fc1(self.norm2(x))))


class VitEncoder(nn.Module):
    """The layer stack; ``forward`` returns the hidden states transformers reports (the input,
    then every layer's output) up to the deepest one asked for."""

    def __init__(self, cfg: dict[str, Any], dtype: torch.dtype) -> None:
        super().__init__()
        self.layers = nn.ModuleList(VitLayer(cfg, dtype) for _ in range(int(cfg["num_hidden_layers"])))

    def load(self, src: WeightSource, p: str) -> None:
        for i, layer in enumerate(self.layers):
            layer.load(src, f"{p}encoder.layers.{i}.")

    def forward(self, x: torch.Tensor, depth: int | None = None) -> list[torch.Tensor]:
        states = [x]
        for layer in list(self.layers)[: len(self.layers) if depth is None else depth]:
            x = layer(x)
            states.append(x)
        return states

    def absolute(self, indices: tuple[int, ...]) -> tuple[int, ...]:
        """Hidden-state ``indices`` (negative from the end, as in HF) as positions in the full list."""
        n = len(self.layers)
        return tuple(i if i >= 0 else n + 1 + i for i in indices)
