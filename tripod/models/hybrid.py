"""What the state-space hybrids (Nemotron-H, Granite 4.0, LFM2) share in the engine: a layer whose
mixer is Mamba2, a short convolution or attention, and the decoder shell around them.

The shell is ``LlamaForCausalLM``'s (embedding, final norm, LM head, the step over a flat
``ForwardBatch``); each family builds its layers from the HF config (``cfg.hybrid.hf``,
``models/hybrid_config.py``) and loads their weights. Per layer kind:

- attention: tripod's ``GQAttention`` on the paged KV pool (the attention layers are the pool's
  layers, in order); a family without positional encoding (Nemotron-H, Granite 4.0-H) gets a
  rotary whose table is cos = 1, sin = 0: ``x * 1 + y * 0 == x`` exactly, on every backend;
- Mamba2 / short conv: their per-sequence state in the engine's ``StatePool`` (``state_spec``
  lists each such layer's shapes in layer order): the step's items' slots are gathered into the
  ``[S, ...]`` state the mixer takes (items in row order, ``lens`` their tokens), the mixer
  advances it, and it is written back to the slots.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from tripod.layers.batch import Backend, StateRows
from tripod.layers.linear import StoredWeight, fuse_rows, release_sites
from tripod.layers.mamba2 import Mamba2Config, Mamba2Mixer
from tripod.layers.mlp import GatedMLP, keep
from tripod.layers.moe import MoE
from tripod.layers.parallel import SINGLE, ParallelGroup
from tripod.layers.short_conv import ShortConv
from tripod.layers.weights import WeightSource
from tripod.memory.state_pool import StateSpec
from tripod.models.config import ModelConfig
from tripod.models.gqa import GQAttention
from tripod.models.llama import LlamaForCausalLM, StepContext


def number_layers(layers: Iterable[nn.Module], kind: Callable[[Any], str | None]) -> None:
    """Number a hybrid's layers in layer order: each ``"attention"`` layer gets its K/V layer in the
    pool (``pool_layer``), each ``"state"`` layer its entry of the state pool (``state_index``);
    ``None``: neither (an MLP-only block)."""
    pool_layer = state_index = 0
    for layer in layers:
        k = kind(layer)
        if k == "attention":
            layer.pool_layer = pool_layer
            pool_layer += 1
        elif k == "state":
            layer.state_index = state_index
            state_index += 1


def step_lens(states: StateRows, rows: int) -> tuple[torch.Tensor, list[int]]:
    """The step's state slots and token counts, items in row order (the mixers' layout: each
    item's rows follow the previous item's)."""
    items = sorted(states.items)
    row, slots, lens = 0, [], []
    for first, n, slot in items:
        assert first == row, "a step's items cover its rows one after another"
        slots.append(slot)
        lens.append(n)
        row += n
    assert row == rows, f"the step's items cover {row} of its {rows} rows"
    return torch.tensor(slots, dtype=torch.long, device=states.pool.tensors[0][0].device), lens


MixerRun = Callable[[list[torch.Tensor], list[int], dict[int, list[torch.Tensor]] | None], torch.Tensor]


def mix_on_slots(states: StateRows, index: int, rows: int, run: MixerRun) -> torch.Tensor:
    """Run a linear layer's mixer on the step's state slots: its entry ``index`` of the state pool
    gathered into the stacked ``[S, ...]`` tensors the mixers take (items in row order),
    ``run(held, lens, trace)`` advancing them in place, then written back to the slots.
    NOTE: gathered copies: the slots of a step are arbitrary, the mixers want their sequences'
    states stacked. ``trace``: the verify items' sequences (``StateTrace.wants``), whose states
    before and after every row the mixer appends (copies of what its token steps produced); they
    go to the step's ``StateTrace`` so a rejected draft rolls back exactly. None: no verify item."""
    slots, lens = step_lens(states, rows)
    pooled = states.pool.tensors[index]
    held = [t.index_select(0, slots) for t in pooled]
    order = slots.tolist()
    trace = ({s: [] for s, slot in enumerate(order) if states.trace.wants(slot)}
             if states.trace is not None else None)
    out = run(held, lens, trace or None)
    for t, s in zip(pooled, held, strict=True):
        t.index_copy_(0, slots, s)
    if trace and states.trace is not None:
        for s, kept in trace.items():
            states.trace.put(index, order[s], kept)
    return out


class HybridLayer(nn.Module):
    """One layer of a state-space hybrid: its mixer (Mamba2, short conv, attention, or none for
    Nemotron-H's MLP/MoE layers) reached through ``mix``; a family adds the norms and FFN.
    ``pool_layer``: an attention layer's K/V layer in the pool; ``state_index``: a Mamba2 /
    short-conv layer's place in the ``StatePool``."""

    def __init__(self, index: int, mixer: Mamba2Mixer | ShortConv | GQAttention | None) -> None:
        super().__init__()
        self.layer = index
        self.pool_layer = -1
        self.state_index = -1
        self.mixer = mixer
        # A GGUF's codes of the projections run as stored (``StateSpaceHybrid.load_stored``), by site:
        # the mixer's ("qkv" / "o", "in_proj" / "out_proj") and the family's FFN's.
        self.stored: dict[str, StoredWeight] = {}

    def state_shapes(self) -> tuple[tuple[int, ...], ...] | None:
        m = self.mixer
        if isinstance(m, Mamba2Mixer):
            return m.cfg.state_shapes()
        if isinstance(m, ShortConv):
            return (m.state_shape,)
        return None

    def mix(self, h: torch.Tensor, ctx: StepContext, residual: torch.Tensor | None = None) -> torch.Tensor:
        m, batch = self.mixer, ctx.batch
        if isinstance(m, GQAttention):
            rotary, cos_sin = ctx.rope(self.layer)
            return m(h, self.pool_layer, ctx.pool, batch, rotary, cos_sin, residual)
        assert isinstance(m, Mamba2Mixer | ShortConv)
        states = batch.states
        assert states is not None, "a hybrid model's step carries its requests' state slots"
        if isinstance(m, Mamba2Mixer) and batch.backend.recurrent_kernels:  # kernels read the slots in place
            return m.forward_slots(h, batch.backend, states, self.state_index, residual=residual)
        return mix_on_slots(states, self.state_index, h.shape[0], lambda held, lens, trace: m(
            h, batch.backend, *held, lens, residual=residual, trace=trace))

    def prepare(self, backend: Backend) -> None:
        if self.mixer is not None:
            self.mixer.prepare(backend, self.stored)

    def stored_parts(self, p: str) -> dict[str, list[str]]:
        """The HF names (this layer's prefix ``p``) whose stored codes make each site of ``stored``
        (rows concatenated in order, ``fuse_rows``): the mixer's here, a family adds its FFN's."""
        m = self.mixer
        if isinstance(m, GQAttention):
            a = p + self.attn_prefix
            return {"qkv": [a + f"{n}_proj.weight" for n in "qkv"], "o": [f"{a}{self.o_name}.weight"]}
        if isinstance(m, Mamba2Mixer | ShortConv):
            return {"in_proj": [p + self.state_prefix + "in_proj.weight"], "out_proj": [p + self.state_prefix + "out_proj.weight"]}
        return {}

    def stored_sites(self, form: str) -> list[tuple[str, nn.Parameter, Any]]:
        """``(site, dense weight, form's linear)`` of each projection that may run as stored codes
        (``models/llama.release_sites``): the mixer's here, a family adds its FFN's."""
        m = self.mixer
        ops = getattr(m, "ops", {}).get(form)
        if ops is None:
            return []
        if isinstance(m, GQAttention):
            return [("qkv", m.qkv, ops[0]), ("o", m.o, ops[1])]
        assert isinstance(m, Mamba2Mixer | ShortConv)
        return [("in_proj", m.in_proj, ops[0]), ("out_proj", m.out_proj, ops[1])]

    def release(self, form: str) -> None:
        """Forget ``form``'s packed weights in every part (a part's own ``release`` where it has one)."""
        for mod in self.modules():
            if mod is self:
                continue
            release = getattr(mod, "release", None)
            if callable(release):
                release(form)
            elif isinstance(getattr(mod, "ops", None), dict):
                mod.ops.pop(form, None)

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        raise NotImplementedError

    # HF name prefixes of the mixer's projections (a family sets its own)
    attn_prefix = "self_attn."
    o_name = "o_proj"
    state_prefix = "mamba."


def mlp_sites(mlp: GatedMLP | Any, form: str, keys: tuple[str, str] = ("gate_up", "down"),
              attrs: tuple[str, str] = ("gate_up", "down")) -> list[tuple[str, nn.Parameter, Any]]:
    """``HybridLayer.stored_sites`` of a two-projection MLP (gated: ``gate_up`` / ``down``; plain:
    ``up`` / ``down``) whose linears for ``form`` are ``mlp.ops[form]``."""
    ops = mlp.ops.get(form)
    return [] if ops is None else [(k, getattr(mlp, a), op) for k, a, op in zip(keys, attrs, ops, strict=True)]


class StateSpaceHybrid(LlamaForCausalLM):
    """The decoder shell of the state-space hybrids: ``LlamaForCausalLM``'s step over the engine's
    batch with the family's layers (``make_layer`` from ``cfg.hybrid.hf``), its weight names
    (``embed_name``, ``norm_name``) and multipliers (``embed_mult``, ``logits_div``)."""

    # Every linear layer records its state after each verified row (memory/state_pool.StateTrace):
    # speculative verification and jump-forward roll a rejection back exactly.
    traces_states = True

    embed_name = "model.embed_tokens.weight"
    norm_name = "model.norm.weight"
    uses_rope = True
    disk_prefix: str | None = None  # what the checkpoint files name ``model.`` (Nemotron-H: ``backbone.``)

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        if cfg.hybrid is None or cfg.hybrid.hf is None:
            raise ValueError(f"{cfg.architecture} is built from its HF config (ModelConfig.from_hf_dict)")
        super().__init__(cfg, dtype, device)
        number_layers(self.layers, lambda layer: "attention" if isinstance(layer.mixer, GQAttention)
                      else "state" if layer.state_shapes() is not None else None)
        if not self.uses_rope:  # identity rotary (module doc)
            self.rotary.cos = torch.ones_like(self.rotary.cos)
            self.rotary.sin = torch.zeros_like(self.rotary.sin)
        self.logits_div = 1.0

    @property
    def hf(self) -> dict[str, Any]:
        assert self.cfg.hybrid is not None and self.cfg.hybrid.hf is not None
        return self.cfg.hybrid.hf

    def set_embed_mult(self, mult: float) -> None:
        self.embed_scale = torch.tensor(mult, dtype=self.dtype) if mult != 1.0 else None

    def state_spec(self) -> StateSpec:
        """Every Mamba2 / short-conv layer's per-sequence state, in layer order (the pool's layout)."""
        return StateSpec(tuple(s for layer in self.layers if (s := layer.state_shapes()) is not None))

    def attention(self, i: int, scale: float | None = None) -> GQAttention:
        """tripod's attention for layer ``i`` (the config's heads, biases, q/k norms)."""
        attn = GQAttention(self.cfg, i, self.cfg.attention_bias, self.dtype)
        if scale is not None:
            attn.spec = dataclasses.replace(attn.spec, scale=scale)
        return attn

    def _logits(self, x: torch.Tensor, batch: Any) -> torch.Tensor:
        logits = super()._logits(x, batch)
        return logits / self.logits_div if self.logits_div != 1.0 else logits

    def load_weights(self, weights: Mapping[str, torch.Tensor], fp8_block: tuple[int, int] | None = None,
                     tp: ParallelGroup = SINGLE, expert_parallel: bool = False) -> None:
        if fp8_block is not None or tp.size > 1:
            raise ValueError(f"{self.cfg.architecture} loads dequantized weights on one rank only")
        if self.disk_prefix is not None and self.embed_name not in weights:
            weights = Renamed(weights, "model.", self.disk_prefix)
        src = WeightSource(weights, self.dtype, self.device)
        self.embed.data = src.get(self.embed_name).contiguous()
        self.norm.data = src.get(self.norm_name)
        if self.lm_head is not None:
            self.lm_head.data = src.get("lm_head.weight").contiguous() if src.has("lm_head.weight") else self.embed.data
        for layer in self.layers:
            self.load_layer(layer, src, f"model.layers.{layer.layer}.")

    def load_layer(self, layer: Any, src: WeightSource, p: str) -> None:
        raise NotImplementedError

    def load_stored(self, stored: Mapping[str, StoredWeight]) -> None:
        """A GGUF's codes (HF names, rows in HF order: ``loader/gguf_hybrid.py``) of each layer's sites
        (``HybridLayer.stored_parts``: a fused site only when every part is stored in one kind, else it
        runs dequantized), a family's routed experts (``load_stored_experts``) and the head."""
        for layer in self.layers:
            found = {k: fuse_rows([stored.get(n) for n in names])
                     for k, names in layer.stored_parts(f"model.layers.{layer.layer}.").items()}
            layer.stored = {k: v for k, v in found.items() if v is not None}
            self.load_stored_experts(layer, stored)
        tied = self.lm_head is None or self.lm_head.data_ptr() == self.embed.data_ptr()
        self.stored_head = fuse_rows([stored.get(self.embed_name if tied else "lm_head.weight")])

    def load_stored_experts(self, layer: Any, stored: Mapping[str, StoredWeight]) -> None:
        """A family with routed experts the stored path runs (``ExpertSet.load_stored``) takes them here."""

    def release_dense_stored(self, form: str) -> int:
        """``LlamaForCausalLM.release_dense_stored`` over each layer's sites (``HybridLayer.stored_sites``)
        and its routed experts (a ``MoE``'s ``release_dense``)."""
        freed = 0
        for layer in self.layers:
            freed += release_sites(layer.stored, layer.stored_sites(form))
            moe = getattr(layer, "moe", None)
            freed += moe.release_dense(form) if isinstance(moe, MoE) else 0
        return freed

    @property
    def has_stored_weights(self) -> bool:
        return self.stored_head is not None or any(
            layer.stored or getattr(getattr(layer, "moe", None), "has_stored", False) for layer in self.layers)


class Renamed(Mapping[str, torch.Tensor]):
    """``weights`` seen with ``new`` in place of the leading ``old`` of their names (a family whose
    files name the decoder differently from transformers' in-memory modules)."""

    def __init__(self, weights: Mapping[str, torch.Tensor], new: str, old: str) -> None:
        self.weights, self.new, self.old = weights, new, old

    def _name(self, key: str) -> str:
        return self.old + key[len(self.new):] if key.startswith(self.new) else key

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.weights[self._name(key)]

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self._name(key) in self.weights

    def __iter__(self) -> Iterator[str]:
        for k in self.weights:
            yield self.new + k[len(self.old):] if k.startswith(self.old) else k

    def __len__(self) -> int:
        return len(self.weights)


def load_attention(attn: GQAttention, src: WeightSource, a: str, o_name: str = "o_proj",
                   norms: tuple[str, str] = ("q_norm", "k_norm")) -> None:
    """An attention layer's weights under HF names (a family may name its output projection and
    q/k norms its own way)."""
    names = [a + "q_proj.", a + "k_proj.", a + "v_proj."]
    keep(attn, "qkv", src.cat([n + "weight" for n in names]))
    keep(attn, "o", src.part(f"{a}{o_name}.weight"))
    if attn.qkv_bias is not None:
        attn.qkv_bias.data = torch.cat([src.get(n + "bias") for n in names])
    if attn.o_bias is not None:
        attn.o_bias.data = src.get(f"{a}{o_name}.bias")
    if attn.q_norm is not None and attn.k_norm is not None:
        attn.q_norm.data = src.get(f"{a}{norms[0]}.weight")
        attn.k_norm.data = src.get(f"{a}{norms[1]}.weight")


def mamba_config(d: Mapping[str, Any], **names: str) -> Mamba2Config:
    """A family's Mamba2 geometry from its HF config dict; ``names`` maps each field to the key
    that family uses for it."""
    get = {f: d[k] for f, k in names.items() if k in d}
    limit = d.get("time_step_limit") or (0.0, float("inf"))
    return Mamba2Config(dt_limit=(_json_float(limit[0]), _json_float(limit[1])), **get)


def _json_float(v: Any) -> float:
    """A float as transformers writes it to config.json (``{"__float__": "Infinity"}`` for inf)."""
    if isinstance(v, dict) and "__float__" in v:
        return float(v["__float__"])
    return float(v)
