"""LoRA adapters (PEFT folders) applied per row of a mixed batch.

A PEFT adapter holds, per targeted projection, ``lora_A`` ``[r, in]`` and ``lora_B`` ``[out, r]``;
the adapted projection is ``W x + s · B (A x)`` with ``s = alpha / r`` (``alpha / sqrt(r)`` with
rsLoRA). tripod fuses Q/K/V and gate/up into one projection each, so an adapter is kept per
*site* of a layer (``qkv``, ``o``, ``gate_up``, ``down``): the parts' ``A`` stacked ``[Σr, in]`` and
their ``B`` placed block-diagonally ``[out, Σr]`` (the scale folded in), so a site's delta is two
matmuls whichever of its parts the adapter targets.

A step's batch mixes requests of several adapters and of the base model. The resident adapters sit
in a ``LoraPool`` (per site, every adapter's A and B stacked, zero-padded to the widest); after
each base projection (whatever backend computed it) ``LoraBatch`` adds each row's delta: the
decode rows run every resident adapter at once as two dense matmuls per site, masked to their own
adapter's columns in between (no per-adapter loop, no gathered copies of the weights: the idea of
Punica / S-LoRA's batched kernels with dense ops), a prefill chunk (one request, one adapter) its
own pair of matmuls.
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

# PEFT module name -> (tripod site, index of the part within the fused site), in a layer's order
MODULE_SITES = {"q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "o_proj": ("o", 0),
                "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "down_proj": ("down", 0)}
SUPPORTED_MODULES = tuple(MODULE_SITES)
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
    slot: int | None = None  # its place in the LoraPool while resident

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
        if m is None or m.group(3) not in MODULE_SITES:
            raise LoraError(f"{path}: tensor {key!r} is not a LoRA weight of a supported projection "
                            f"({', '.join(SUPPORTED_MODULES)}); embeddings, heads and experts are not adapted")
        layer = int(m.group(1))
        if layer >= cfg.num_layers:
            raise LoraError(f"{path}: {key!r} is for layer {layer}, the base model has {cfg.num_layers}")
        site, idx = MODULE_SITES[m.group(3)]
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


class LoraPool:
    """The resident adapters' weights, stacked per (layer, site) and stored transposed for the
    matmuls: ``A`` as ``[in, slots, R]`` and ``B`` as ``[slots, R, out]`` (``R``: the widest resident
    adapter's width at that site; narrower ones and sites an adapter leaves alone are zeros).
    Flattened they are one ``[in, slots·R]`` and one ``[slots·R, out]`` matrix: a step's single-row
    items (decodes) run the adapters of slots ``0 .. used - 1`` at once as two dense matmuls over
    those columns, each row's product masked to its own adapter's in between."""

    def __init__(self, slots: int, cfg: Any, dtype: torch.dtype, device: torch.device) -> None:
        self.slots, self.dtype, self.device = slots, dtype, device
        self.shapes = {site: (parts[0][0], sum(o for _, o in parts)) for site, parts in site_shapes(cfg).items()}
        self.sites: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}

    def put(self, slot: int, adapter: LoraAdapter) -> None:
        for key in set(self.sites) | set(adapter.sites):
            a, b = adapter.sites.get(key, (None, None))
            width = 0 if a is None else a.shape[0]
            at, bt = self._site(key, width)
            at[:, slot].zero_()
            bt[slot].zero_()
            if a is not None and b is not None:
                at[:, slot, :width] = a.t()
                bt[slot, :width] = b.t()

    def _site(self, key: tuple[int, str], width: int) -> tuple[torch.Tensor, torch.Tensor]:
        d_in, d_out = self.shapes[key[1]]
        have = self.sites.get(key)
        if have is not None and have[0].shape[2] >= width:
            return have
        at = torch.zeros(d_in, self.slots, width, dtype=self.dtype, device=self.device)
        bt = torch.zeros(self.slots, width, d_out, dtype=self.dtype, device=self.device)
        if have is not None:  # grown for a wider adapter: the others' columns kept
            old = have[0].shape[2]
            at[:, :, :old] = have[0]
            bt[:, :old] = have[1]
        self.sites[key] = (at, bt)
        return at, bt


@dataclass(slots=True)
class LoraBatch:
    """A step's rows that run adapters: single rows (decodes) with their adapters' pool slots (all
    of them at once, masked per row); runs of rows (prefill chunks, verifications), each one
    adapter's; ``groups``: adapters outside the pool (a pass outside the steps) with their rows."""

    pool: LoraPool | None = None
    rows: torch.Tensor | None = None  # single rows ...
    slots: torch.Tensor | None = None  # ... and their adapters' pool slots
    runs: list[tuple[int, int, int]] = field(default_factory=list)  # (first row, rows, slot)
    groups: list[tuple[LoraAdapter, torch.Tensor]] = field(default_factory=list)
    masks: dict[int, torch.Tensor] = field(default_factory=dict)
    span: tuple[int, int] | None = None  # (first, count) when ``rows`` are one contiguous range
    used: int = 0  # the pool slots the single rows reach: 0 .. used - 1

    def apply(self, layer: int, site: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` (the base projection of ``x``) plus each row's adapter delta."""
        w = self.pool.sites.get((layer, site)) if self.pool is not None else None
        if w is not None:
            at, bt = w
            width = at.shape[2]
            if self.rows is not None and self.slots is not None:
                r0, n = self.span if self.span is not None else (0, 0)
                xs = x[r0 : r0 + n] if self.span is not None else x.index_select(0, self.rows)
                used = self.used * width  # (slots are handed out lowest first: the ones in use lead)
                t = xs.to(at.dtype) @ at.view(at.shape[0], -1)[:, :used]  # [rows, used·R]: each adapter's product ...
                delta = (t * self._mask(width, t.dtype)) @ bt.view(-1, bt.shape[-1])[:used]  # ... kept on the row's own
                if self.span is not None:  # (the rows are one contiguous range: no scatter)
                    y[r0 : r0 + n] += delta
                else:
                    y.index_add_(0, self.rows, delta.to(y.dtype))
            for first, n, slot in self.runs:
                y[first : first + n] += (x[first : first + n].to(at.dtype) @ at[:, slot]) @ bt[slot]
        for adapter, rows in self.groups:
            ab = adapter.sites.get((layer, site))
            if ab is not None:
                delta = (x.index_select(0, rows).to(ab[0].dtype) @ ab[0].t()) @ ab[1].t()
                y.index_add_(0, rows, delta.to(y.dtype))
        return y

    def _mask(self, width: int, dtype: torch.dtype) -> torch.Tensor:
        """``[rows, slots·width]``: 1 on each row's own adapter's columns (made once per width and step)."""
        m = self.masks.get(width)
        if m is None:
            assert self.slots is not None and self.pool is not None
            own = torch.nn.functional.one_hot(self.slots, self.used).to(dtype)
            m = self.masks[width] = own.repeat_interleave(width, dim=1)
        return m
