"""NVIDIA Nemotron-H / Nemotron 3 (``NemotronHForCausalLM``): one mixer per layer, chosen by
``layers_block_type`` (or the older ``hybrid_override_pattern``: ``M`` Mamba2, ``*`` attention,
``-`` MLP, ``E`` MoE), each as ``x + mixer(rmsnorm(x))``.

- Mamba2: ``layers/mamba2.py`` (projection biases from ``use_bias``);
- attention: grouped-query, no positional encoding (the Mamba2 layers carry position), no biases;
- MLP: ``down(relu(up(x))²)``, not gated;
- MoE: sigmoid router with a correction bias (used to choose, not to weight), optional expert
  groups, top-k renormalised and scaled; non-gated ReLU² experts, optionally behind a latent
  projection; plus a shared expert on the layer's input.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tripod.layers.batch import Backend
from tripod.layers.linear import Linear, StoredWeight
from tripod.layers.mamba2 import Mamba2Config, Mamba2Mixer
from tripod.layers.moe import MoEConfig, route
from tripod.layers.weights import WeightSource
from tripod.models.gqa import GQAttention, new_param
from tripod.models.hybrid import (
    HybridLayer,
    StateSpaceHybrid,
    load_attention,
    mamba_config,
    mlp_sites,
)
from tripod.models.hybrid_config import nemotron_kinds
from tripod.models.llama import StepContext

layer_kinds = nemotron_kinds  # (the name the mixer-level tests know)


def activation(name: str) -> Any:
    if name == "relu2":
        return lambda x: torch.square(F.relu(x))
    if name == "silu":
        return F.silu
    raise ValueError(f"Nemotron-H MLP activation {name!r} is not supported (relu2 or silu)")


class PlainMLP(nn.Module):
    """``down(act(up(x)))``: Nemotron-H's dense MLP and its shared expert."""

    def __init__(self, hidden: int, inter: int, act: str, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.act = activation(act)
        self.up = new_param(inter, hidden, dtype=dtype)
        self.down = new_param(hidden, inter, dtype=dtype)
        self.up_bias = new_param(inter, dtype=dtype, fill=0.0) if bias else None
        self.down_bias = new_param(hidden, dtype=dtype, fill=0.0) if bias else None
        self.ops: dict[str, tuple[Linear, Linear]] = {}

    def load(self, src: WeightSource, p: str) -> None:
        self.up.data = src.get(p + "up_proj.weight").contiguous()
        self.down.data = src.get(p + "down_proj.weight").contiguous()
        if self.up_bias is not None and self.down_bias is not None:
            self.up_bias.data, self.down_bias.data = src.get(p + "up_proj.bias"), src.get(p + "down_proj.bias")

    def prepare(self, backend: Backend, stored: Mapping[str, StoredWeight]) -> None:
        """``stored``: a GGUF's codes of ``up`` / ``down`` (run as stored on a backend that does)."""
        if backend.form not in self.ops:
            self.ops[backend.form] = (backend.linear(self.up, self.up_bias, stored=stored.get("up")),
                                      backend.linear(self.down, self.down_bias, stored=stored.get("down")))

    def forward(self, h: torch.Tensor, backend: Backend) -> torch.Tensor:
        up, down = self.ops[backend.form]
        return down(self.act(up(h)))


class NemotronHMoE(nn.Module):
    """Router, stacked non-gated experts (``up`` ``[E, I, L]``, ``down`` ``[E, L, I]``, ``L`` the
    latent size or the hidden size), the optional latent projections and the shared expert."""

    def __init__(self, d: Mapping[str, Any], dtype: torch.dtype) -> None:
        super().__init__()
        h, e, i = d["hidden_size"], d["n_routed_experts"], d["moe_intermediate_size"]
        lat = d.get("moe_latent_size") or h
        self.spec = MoEConfig(
            num_experts=e, top_k=d["num_experts_per_tok"], intermediate_size=i, scoring="sigmoid",
            norm_topk_prob=d.get("norm_topk_prob", True), routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
            topk_method="group_top2", n_group=d.get("n_group", 1), topk_group=d.get("topk_group", 1), correction_bias=True,
        )
        self.act = activation(d.get("mlp_hidden_act", "relu2"))
        self.router = nn.Parameter(torch.empty(e, h, dtype=torch.float32), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(e, dtype=torch.float32), requires_grad=False)
        self.up = new_param(e, i, lat, dtype=dtype)
        self.down = new_param(e, lat, i, dtype=dtype)
        self.latent = d.get("moe_latent_size") is not None
        bias = bool(d.get("mlp_bias", False))
        self.fc1 = new_param(lat, h, dtype=dtype) if self.latent else None
        self.fc2 = new_param(h, lat, dtype=dtype) if self.latent else None
        if bias and self.latent:
            raise ValueError("Nemotron-H latent MoE projections with biases (mlp_bias) are not supported")
        self.shared = PlainMLP(h, d["moe_shared_expert_intermediate_size"], d.get("mlp_hidden_act", "relu2"), bias, dtype)
        self.ops: dict[str, tuple[Linear, Linear]] = {}

    def load(self, src: WeightSource, p: str) -> None:
        self.router.data = src.get_f32(p + "gate.weight")
        self.bias.data = src.get_f32(p + "gate.e_score_correction_bias")
        if src.has(p + "experts.up_proj"):  # stacked (transformers' in-memory form)
            self.up.data = src.get(p + "experts.up_proj").contiguous()
            self.down.data = src.get(p + "experts.down_proj").contiguous()
        else:  # per expert, as the checkpoint files hold them
            experts = range(self.up.shape[0])
            self.up.data = torch.stack([src.get(f"{p}experts.{e}.up_proj.weight") for e in experts]).contiguous()
            self.down.data = torch.stack([src.get(f"{p}experts.{e}.down_proj.weight") for e in experts]).contiguous()
        if self.fc1 is not None and self.fc2 is not None:
            self.fc1.data = src.get(p + "fc1_latent_proj.weight").contiguous()
            self.fc2.data = src.get(p + "fc2_latent_proj.weight").contiguous()
        self.shared.load(src, p + "shared_experts.")

    def prepare(self, backend: Backend, stored: Mapping[str, StoredWeight]) -> None:
        self.shared.prepare(backend, stored)
        if self.fc1 is not None and self.fc2 is not None and backend.form not in self.ops:
            self.ops[backend.form] = (backend.linear(self.fc1, None), backend.linear(self.fc2, None))

    def forward(self, h: torch.Tensor, backend: Backend) -> torch.Tensor:
        weights, idx = route(F.linear(h.float(), self.router), self.spec, self.bias)
        x = self.ops[backend.form][0](h) if self.latent else h
        out = torch.zeros_like(x)
        # NOTE: experts in ascending order, each token at most once per expert: the same sum order
        # whatever the batch (and as transformers' loop).
        for e in idx.unique().tolist():
            tok, slot = (idx == e).nonzero(as_tuple=True)
            y = self.act(x.index_select(0, tok) @ self.up[e].t()) @ self.down[e].t()
            # (tokens are distinct within one expert: a gather-add-scatter, cheaper than index_add_ here)
            out.index_copy_(0, tok, out.index_select(0, tok) + y * weights[tok, slot].to(x.dtype).unsqueeze(1))
        if self.latent:
            out = self.ops[backend.form][1](out)
        return out + self.shared(h, backend)


class NemotronHLayer(HybridLayer):
    """``x + mixer(rmsnorm(x))`` with one of the four mixers (MLP / MoE: the layer's ``ffn``)."""

    def __init__(self, index: int, kind: str, model: NemotronHForCausalLM) -> None:
        d, dtype = model.hf, model.dtype
        h = d["hidden_size"]
        mixer: Mamba2Mixer | GQAttention | None = None
        if kind == "linear_attention":
            mixer = Mamba2Mixer(nemotron_mamba(d), dtype)
        elif kind == "full_attention":
            mixer = model.attention(index)
        super().__init__(index, mixer)
        self.kind = kind
        self.eps = float(d.get("layer_norm_epsilon", 1e-5))
        self.norm = new_param(h, dtype=dtype, fill=1.0)
        self.ffn: PlainMLP | NemotronHMoE | None = None
        if kind == "mlp":
            self.ffn = PlainMLP(h, d["intermediate_size"], d.get("mlp_hidden_act", "relu2"), bool(d.get("mlp_bias")), dtype)
        elif kind == "moe":
            self.ffn = NemotronHMoE(d, dtype)

    attn_prefix = state_prefix = "mixer."

    def prepare(self, backend: Backend) -> None:
        super().prepare(backend)
        if self.ffn is not None:
            self.ffn.prepare(backend, self.stored)

    def stored_parts(self, p: str) -> dict[str, list[str]]:
        """The mixer's sites, or the MLP's (a MoE's shared expert) ``up`` / ``down``. NOTE: the routed
        experts stay dense (their loop here runs the stacked weights, not ``ExpertSet``'s stored linears)."""
        if self.ffn is None:
            return super().stored_parts(p)
        m = p + ("mixer.shared_experts." if isinstance(self.ffn, NemotronHMoE) else "mixer.")
        return {"up": [m + "up_proj.weight"], "down": [m + "down_proj.weight"]}

    def stored_sites(self, form: str) -> list[tuple[str, nn.Parameter, Any]]:
        if self.ffn is None:
            return super().stored_sites(form)
        mlp = self.ffn.shared if isinstance(self.ffn, NemotronHMoE) else self.ffn
        return mlp_sites(mlp, form, ("up", "down"), ("up", "down"))

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        h = ctx.batch.backend.norm(x, self.norm, self.eps)
        if self.ffn is not None:
            return x + self.ffn(h, ctx.batch.backend)
        return self.mix(h, ctx, residual=x)


# older Nemotron-H config.json names of the Mamba2 fields (transformers renames them the same way)
LEGACY_KEYS = {"mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel", "mamba_conv_bias": "use_conv_bias",
               "mamba_dt_limit": "time_step_limit"}


def nemotron_mamba(d: Mapping[str, Any]) -> Mamba2Config:
    d = {**{new: d[old] for old, new in LEGACY_KEYS.items() if old in d and new not in d}, **d}
    missing = [k for k in ("mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups", "conv_kernel") if k not in d]
    if missing:
        raise ValueError(f"a Nemotron-H config with Mamba2 layers needs {', '.join(missing)}")
    cfg = mamba_config(d, hidden_size="hidden_size", num_heads="mamba_num_heads", head_dim="mamba_head_dim",
                       state_size="ssm_state_size", n_groups="n_groups", conv_kernel="conv_kernel",
                       eps="layer_norm_epsilon", conv_bias="use_conv_bias", proj_bias="use_bias",
                       activation="mamba_hidden_act")
    return cfg


class NemotronHForCausalLM(StateSpaceHybrid):
    """Nemotron-H: Mamba2, attention (no positional encoding), MLP and MoE layers
    (``layers_block_type``); MTP layers are not loaded (no speculative path for them here)."""

    embed_name = "model.embeddings.weight"
    norm_name = "model.norm_f.weight"
    uses_rope = False
    disk_prefix = "backbone."

    def make_layer(self, i: int) -> NemotronHLayer:  # type: ignore[override]
        return NemotronHLayer(i, nemotron_kinds(self.hf)[i], self)

    def load_layer(self, layer: Any, src: WeightSource, p: str) -> None:
        layer.norm.data = src.get(p + "norm.weight")
        if isinstance(layer.mixer, GQAttention):
            load_attention(layer.mixer, src, p + "mixer.")
            return
        target = layer.ffn if layer.ffn is not None else layer.mixer
        target.load(src, p + "mixer.")
