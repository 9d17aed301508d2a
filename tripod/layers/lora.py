"""LoRA adapters (PEFT folders) applied per row of a mixed batch.

A PEFT adapter holds, per targeted projection, ``lora_A`` ``[r, in]`` and ``lora_B`` ``[out, r]``;
the adapted projection is ``W x + s · B (A x)`` with ``s = alpha / r`` (``alpha / sqrt(r)`` with
rsLoRA). tripod fuses Q/K/V and gate/up into one projection each, so an adapter is kept per
*site* of a layer (``qkv``, ``o``, ``gate_up``, ``down``): the parts' ``A`` stacked ``[Σr, in]`` and
their ``B`` placed block-diagonally ``[out, Σr]`` (the scale folded in), so a site's delta is two
matmuls whichever of its parts the adapter targets.

A step's batch mixes requests of several adapters and of the base model: ``LoraBatch`` groups the
batch's rows by adapter and, after each base projection (whatever backend computed it), adds each
group's delta to its rows — one gathered pair of matmuls per adapter present (the Punica / S-LoRA
idea, with the loop over the adapters in the step, not over rows).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

# PEFT module name -> (tripod site, index of the part within the fused site)
_PARTS = {"q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "o_proj": ("o", 0),
          "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "down_proj": ("down", 0)}
SUPPORTED_MODULES = tuple(_PARTS)
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class LoraError(ValueError):
    """An adapter that cannot be served with this base model (the message says why)."""


@dataclass(slots=True)
class LoraAdapter:
    """One adapter's weights, per (layer, site): ``A`` ``[Σr, in]``, ``B`` ``[out, Σr]`` (scaled)."""

    name: str
    path: str
    rank: int
    digest: str  # of the adapter's files: the same weights under any name share a cache namespace
    sites: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.sites.values())


def site_shapes(cfg: Any) -> dict[str, list[tuple[int, int]]]:
    """Each site's parts as (in, out) for a Llama-shaped model config."""
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv, inter = cfg.num_heads * d, cfg.num_kv_heads * d, cfg.intermediate_size
    return {"qkv": [(h, q), (h, kv), (h, kv)], "o": [(q, h)], "gate_up": [(h, inter), (h, inter)], "down": [(inter, h)]}


def adapter_digest(path: str | Path) -> str:
    p = Path(path)
    h = hashlib.sha256()
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        h.update((p / f).read_bytes())
    return h.hexdigest()


def read_peft(name: str, path: str | Path, cfg: Any, *, max_rank: int, dtype: torch.dtype,
              device: torch.device, dense_layers: set[int] | None = None) -> LoraAdapter:
    """Read and check a PEFT LoRA folder against the base model ``cfg``; ``dense_layers``: the layers
    whose MLP is a plain gated MLP (MLP targets elsewhere are refused). Raises ``LoraError``."""
    from safetensors.torch import load_file

    p = Path(path)
    conf_file, weights_file = p / "adapter_config.json", p / "adapter_model.safetensors"
    if not conf_file.is_file() or not weights_file.is_file():
        raise LoraError(f"{path} is not a PEFT LoRA adapter: it needs adapter_config.json and adapter_model.safetensors")
    try:
        conf = json.loads(conf_file.read_text())
    except json.JSONDecodeError as e:
        raise LoraError(f"{conf_file}: not valid JSON ({e})") from None
    if str(conf.get("peft_type", "LORA")).upper() != "LORA":
        raise LoraError(f"{path}: peft_type {conf.get('peft_type')!r} is not LoRA")
    for key, bad in (("use_dora", True), ("fan_in_fan_out", True)):
        if conf.get(key) == bad:
            raise LoraError(f"{path}: {key} adapters are not supported")
    if conf.get("bias", "none") != "none" or conf.get("modules_to_save"):
        raise LoraError(f"{path}: adapters that train biases or whole modules (modules_to_save) are not supported; "
                        "tripod applies LoRA to the projections " + ", ".join(SUPPORTED_MODULES))
    if conf.get("rank_pattern") or conf.get("alpha_pattern"):
        raise LoraError(f"{path}: per-module ranks (rank_pattern / alpha_pattern) are not supported")
    r, alpha = int(conf.get("r") or 8), float(conf.get("lora_alpha") or 8)
    if not 1 <= r <= max_rank:
        raise LoraError(f"{path}: rank {r} is over --max-lora-rank {max_rank}")
    scale = alpha / math.sqrt(r) if conf.get("use_rslora") else alpha / r
    try:
        tensors = load_file(str(weights_file))
    except Exception as e:
        raise LoraError(f"{weights_file}: not a readable safetensors file ({e})") from None
    parts: dict[tuple[int, str, int], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None or m.group(3) not in _PARTS:
            raise LoraError(f"{path}: tensor {key!r} is not a LoRA weight of a supported projection "
                            f"({', '.join(SUPPORTED_MODULES)}); embeddings, heads and experts are not adapted")
        layer = int(m.group(1))
        if layer >= cfg.num_layers:
            raise LoraError(f"{path}: {key!r} is for layer {layer}, the base model has {cfg.num_layers}")
        site, idx = _PARTS[m.group(3)]
        if site in ("gate_up", "down") and dense_layers is not None and layer not in dense_layers:
            raise LoraError(f"{path}: {key!r} targets the MLP of layer {layer}, which is a mixture of experts here")
        parts.setdefault((layer, site, idx), {})[m.group(4)] = t
    shapes = site_shapes(cfg)
    sites: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for layer, site in sorted({(k[0], k[1]) for k in parts}):
        dims = shapes[site]
        a_rows, b_blocks = [], []
        for idx, (d_in, d_out) in enumerate(dims):
            ab = parts.get((layer, site, idx))
            if ab is None:
                b_blocks.append((d_out, None))
                continue
            if set(ab) != {"A", "B"}:
                raise LoraError(f"{path}: layer {layer} {site} part {idx} has lora_{next(iter(ab))} without its pair")
            a, b = ab["A"], ab["B"]
            if a.shape[1] != d_in or b.shape[0] != d_out or a.shape[0] != b.shape[1] or a.shape[0] > max_rank:
                raise LoraError(f"{path}: layer {layer} {site}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not "
                                f"fit the base model's {d_in} -> {d_out} projection (rank <= {max_rank})")
            a_rows.append(a)
            b_blocks.append((d_out, b))
        a_cat = torch.cat(a_rows).to(device=device, dtype=dtype)
        width = a_cat.shape[0]
        b_full = torch.zeros(sum(d for d, _ in b_blocks), width, dtype=torch.float32)
        row = col = 0
        for d_out, b in b_blocks:
            if b is not None:
                b_full[row : row + d_out, col : col + b.shape[1]] = b.float() * scale
                col += b.shape[1]
            row += d_out
        sites[(layer, site)] = (a_cat.contiguous(), b_full.to(device=device, dtype=dtype).contiguous())
    if not sites:
        raise LoraError(f"{path}: the adapter holds no LoRA weights")
    return LoraAdapter(name=name, path=str(path), rank=r, digest=adapter_digest(p), sites=sites)


@dataclass(slots=True)
class LoraBatch:
    """A step's adapters and the flat rows of each (rows of the base model are in none)."""

    groups: list[tuple[LoraAdapter, torch.Tensor]]

    def apply(self, layer: int, site: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` (the base projection of ``x``) plus each adapter's delta on its rows."""
        for adapter, rows in self.groups:
            w = adapter.sites.get((layer, site))
            if w is None:
                continue
            a, b = w
            delta = (x.index_select(0, rows) @ a.t()) @ b.t()
            y.index_add_(0, rows, delta.to(y.dtype))
        return y
