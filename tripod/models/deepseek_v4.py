"""DeepSeek-V4 (``DeepseekV4ForCausalLM``): compressed attention (``layers/compressed.py``),
hyper-connections, and a MoE in every layer whose first layers route by token id.

Hyper-connections: the residual is ``hc_mult`` streams per token (``[T, n, H]``). Before each
sublayer, weights computed from the (norm-scaled, flattened) streams collapse them into the
sublayer's input (``pre``), and after it spread the output back (``post``) and mix the streams
(``comb``: a softmax made doubly stochastic by Sinkhorn-Knopp iterations); a last collapse
(``hc_head``) precedes the final norm. Everything is per token, so it fits the flat batch.

MoE: sqrt(softplus) router scores, the top-k chosen on score + correction bias (the first
``hash_layers`` take ``tid2eid[token]`` instead), renormalised and scaled; the routed experts and
the shared one use the clamped SwiGLU. Runs on torch's ops; one process (no parallel groups).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tripod.layers.batch import Backend, ForwardBatch
from tripod.layers.compressed import CompressedAttention, InterleavedRope, unweighted_rms
from tripod.layers.moe import ExpertSet, chosen_weights, route, score
from tripod.layers.norm import rms_norm
from tripod.layers.parallel import SINGLE, ParallelGroup, PipeStage
from tripod.layers.weights import WeightSource
from tripod.memory.kv_pool import PoolSpec
from tripod.models.config import ModelConfig, V4Config
from tripod.models.llama import LlamaForCausalLM


def _param(*shape: int, dtype: torch.dtype = torch.float32) -> nn.Parameter:
    return nn.Parameter(torch.zeros(*shape, dtype=dtype), requires_grad=False)


class HyperConnection(nn.Module):
    """The mixing weights of one sublayer's ``n`` residual streams (float32)."""

    def __init__(self, v4: V4Config, hidden: int, eps: float) -> None:
        super().__init__()
        n = v4.hc_mult
        self.n, self.iters, self.hc_eps, self.eps = n, v4.hc_iters, v4.hc_eps, eps
        self.fn = _param((2 + n) * n, n * hidden)
        self.base = _param((2 + n) * n)
        self.scale = _param(3)

    def load(self, src: WeightSource, prefix: str) -> None:
        self.fn.data = src.get_f32(prefix + "fn")
        self.base.data = src.get_f32(prefix + "base")
        self.scale.data = src.get_f32(prefix + "scale")

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Streams ``[T, n, H]`` → (post ``[T, n]``, comb ``[T, n, n]``, the collapsed input ``[T, H]``)."""
        n = self.n
        mixes = F.linear(unweighted_rms(x.reshape(x.shape[0], -1).float(), self.eps), self.fn)
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre = torch.sigmoid(pre_w * self.scale[0] + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * self.scale[1] + post_b)
        comb = torch.softmax(comb_w.view(-1, n, n) * self.scale[2] + comb_b.view(n, n), dim=-1) + self.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        collapsed = (pre.unsqueeze(-1) * x).sum(dim=1).to(x.dtype)
        return post, comb, collapsed


def _spread(x: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """The streams after a sublayer: its output spread by ``post`` plus the streams mixed by ``comb``."""
    dt = x.dtype
    return post.to(dt).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dt).transpose(-1, -2), x)


class V4MoE(nn.Module):
    """Routed experts (top-k, or by token id in a hash layer) plus one shared expert."""

    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        assert cfg.moe is not None and cfg.v4 is not None
        spec, h = cfg.moe, cfg.hidden_size
        self.spec = spec
        self.hashed = layer in cfg.v4.hash_layers
        self.router = _param(spec.num_experts, h)
        self.bias = None if self.hashed else _param(spec.num_experts)
        self.tid2eid: torch.Tensor | None = None
        self.experts = ExpertSet(spec.num_experts, h, spec.intermediate_size, cfg.hidden_act, dtype, spec)
        self.shared = ExpertSet(1, h, spec.shared_intermediate_size, cfg.hidden_act, dtype, spec)

    def load(self, src: WeightSource, prefix: str) -> None:
        self.router.data = src.get_f32(prefix + "gate.weight")
        if self.bias is not None:
            self.bias.data = src.get_f32(prefix + "gate.e_score_correction_bias")
        else:
            self.tid2eid = src.raw(prefix + "gate.tid2eid").to(device=self.router.device, dtype=torch.long)
        self.experts.load(src, prefix + "experts.", ("w1", "w3", "w2"))  # (stacked, or DeepSeek's per expert)
        s = prefix + "shared_experts."
        self.shared.gate_up.data = torch.cat((src.get(s + "gate_proj.weight"), src.get(s + "up_proj.weight")))[None]
        self.shared.down.data = src.get(s + "down_proj.weight")[None].contiguous()

    def forward(self, h: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        logits = F.linear(h.float(), self.router)
        if self.tid2eid is not None:
            idx = self.tid2eid.index_select(0, ids)
            weights = chosen_weights(score(logits, self.spec.scoring), idx, self.spec)
        else:
            weights, idx = route(logits, self.spec, self.bias)
        one = torch.ones(h.shape[0], 1, device=h.device)
        return self.experts(h, weights, idx) + self.shared(h, one, torch.zeros_like(one, dtype=torch.long))


class V4Layer(nn.Module):
    """Hyper-connected attention and MoE sublayers."""

    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype, kind: str | None = None) -> None:
        super().__init__()
        v4 = cfg.v4
        assert v4 is not None
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.layer = self.pool_layer = layer
        self.eps = eps
        self.attn = CompressedAttention(v4.attn, kind or v4.attn.kinds[layer], h, cfg.num_heads, eps, dtype)
        self.mlp = V4MoE(cfg, layer, dtype)
        self.input_norm = _param(h, dtype=dtype)
        self.post_norm = _param(h, dtype=dtype)
        self.attn_hc = HyperConnection(v4, h, eps)
        self.ffn_hc = HyperConnection(v4, h, eps)
        self.stored: dict[str, Any] = {}

    def prepare(self, backend: Backend) -> None:
        """(Its projections run as torch's ops whatever the step's backend.)"""

    def release(self, form: str) -> None:
        """(Nothing prepared per form.)"""

    def load(self, src: WeightSource, p: str) -> None:
        self.input_norm.data = src.get(p + "input_layernorm.weight")
        self.post_norm.data = src.get(p + "post_attention_layernorm.weight")
        self.attn.load(src, p + "self_attn.")
        self.mlp.load(src, p + "mlp.")
        self.attn_hc.load(src, p + "attn_hc.")
        self.ffn_hc.load(src, p + "ffn_hc.")

    def forward(self, x: torch.Tensor, batch: ForwardBatch, pool: Any,
                ropes: tuple[InterleavedRope, InterleavedRope]) -> torch.Tensor:
        post, comb, h = self.attn_hc(x)
        a = self.attn(rms_norm(h, self.input_norm, self.eps), self.pool_layer, pool, batch, ropes)
        x = _spread(x, a, post, comb)
        post, comb, h = self.ffn_hc(x)
        return _spread(x, self.mlp(rms_norm(h, self.post_norm, self.eps), batch.input_ids), post, comb)


class DeepseekV4ForCausalLM(LlamaForCausalLM):
    """DeepSeek-V4: the decoder's embedding, final norm and head around V4's own layers."""

    @property
    def rope_dim(self) -> int:
        assert self.cfg.v4 is not None
        return self.cfg.v4.attn.rope_dim

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        if cfg.v4 is None or cfg.moe is None:
            raise ValueError(f"{cfg.architecture} needs DeepSeek-V4's attention and MoE fields in its config")
        super().__init__(cfg, dtype, device)
        v4 = cfg.v4
        a = v4.attn
        self.ropes = (
            InterleavedRope(a.rope_dim, a.main_theta, None, cfg.max_position_embeddings, device),
            InterleavedRope(a.rope_dim, a.compress_theta, a.compress_scaling, cfg.max_position_embeddings, device),
        )
        self.hc_head = HyperHead(cfg)
        self.mtp: V4MTP | None = None

    def make_layer(self, i: int) -> V4Layer:  # type: ignore[override]
        return V4Layer(self.cfg, i, self.dtype)

    def keep_stage(self, pp: PipeStage) -> None:
        if pp.stages > 1:
            raise ValueError("DeepSeek-V4 runs in one process for now (no --pipeline-parallel-size)")

    def shard(self, tp: ParallelGroup, expert_parallel: bool = False) -> None:
        if tp.size > 1:
            raise ValueError("DeepSeek-V4 runs in one process for now (no --tensor-parallel-size)")

    def truncated(self, num_layers: int) -> LlamaForCausalLM:
        raise ValueError("DeepSeek-V4 has no truncated self-speculative draft (its layers keep several residual streams)")

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, pool: Any) -> torch.Tensor:
        # (one process: no pipeline micro-batches, no data-parallel layout)
        v4 = self.cfg.v4
        assert v4 is not None
        e = self.embed_tokens(batch.input_ids)
        x = e.unsqueeze(1).expand(-1, v4.hc_mult, -1).contiguous()
        for layer in self.layers:
            x = layer(x, batch, pool, self.ropes)
        logits = self._logits(self.hc_head(x), batch)
        if self.capture_hidden:  # the MTP module reads the streams (before the last collapse)
            self.last_hidden = x
        return logits

    def load_weights(self, weights: Mapping[str, torch.Tensor], fp8_block: tuple[int, int] | None = None,
                     tp: ParallelGroup = SINGLE, expert_parallel: bool = False) -> None:
        if tp.size > 1:
            raise ValueError("DeepSeek-V4 runs in one process for now (no --tensor-parallel-size)")
        src = WeightSource(V4Names(weights), self.dtype, self.device, fp8_block)
        self.embed.data = src.get("model.embed_tokens.weight").contiguous()
        self.norm.data = src.get("model.norm.weight")
        if self.lm_head is not None:
            self.lm_head.data = src.get("lm_head.weight").contiguous() if src.has("lm_head.weight") else self.embed.data
        self.hc_head.load(src, "model.hc_head.hc_")
        for layer in self.layers:
            assert isinstance(layer, V4Layer)
            layer.load(src, f"model.layers.{layer.layer}.")
        if self.cfg.num_nextn_predict_layers and src.has("model.mtp.0.e_proj.weight"):
            self.mtp = V4MTP(self)
            self.mtp.load(src)


class HyperHead(nn.Module):
    """The last collapse of the streams (weights only, no post / comb), before the final norm."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        assert cfg.v4 is not None
        n = cfg.v4.hc_mult
        self.eps, self.hc_eps = cfg.rms_norm_eps, cfg.v4.hc_eps
        self.fn = _param(n, n * cfg.hidden_size)
        self.base = _param(n)
        self.scale = _param(1)

    def load(self, src: WeightSource, prefix: str) -> None:
        """``{prefix}fn``, ``base``, ``scale`` (the model's ``hc_head.hc_*``, the MTP's ``hc_head_*``)."""
        self.fn.data = src.get_f32(prefix + "fn")
        self.base.data = src.get_f32(prefix + "base")
        self.scale.data = src.get_f32(prefix + "scale")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mixes = F.linear(unweighted_rms(x.reshape(x.shape[0], -1).float(), self.eps), self.fn)
        pre = torch.sigmoid(mixes * self.scale + self.base) + self.hc_eps
        return (pre.unsqueeze(-1) * x).sum(dim=1).to(x.dtype)


class V4MTP(nn.Module):
    """DeepSeek-V4's multi-token-prediction block (``mtp.0.*``), as DeepSeek's reference defines
    it: the next token's embedding (``enorm`` → ``e_proj``) added to every stream of the target's
    last hidden streams (``hnorm`` → ``h_proj``), one V4 block (sliding-window attention, top-k MoE)
    over them, then its own stream collapse (``hc_head``), ``norm`` and the target's head. Its
    output streams feed it again for chained drafts. Its K/V: a one-layer pool at the target's slots."""

    def __init__(self, target: DeepseekV4ForCausalLM) -> None:
        super().__init__()
        cfg, dtype = target.cfg, target.dtype
        h = cfg.hidden_size
        self.eps = cfg.rms_norm_eps
        self.enorm = _param(h, dtype=dtype)
        self.hnorm = _param(h, dtype=dtype)
        self.norm = _param(h, dtype=dtype)
        self.e_proj = _param(h, h, dtype=dtype)
        self.h_proj = _param(h, h, dtype=dtype)
        self.block = V4Layer(cfg, cfg.num_layers, dtype, kind="sliding")
        self.block.pool_layer = 0
        self.hc_head = HyperHead(cfg)

    def load(self, src: WeightSource) -> None:
        p = "model.mtp.0."
        self.enorm.data = src.get(p + "enorm.weight")
        self.hnorm.data = src.get(p + "hnorm.weight")
        self.norm.data = src.get(p + "norm.weight")
        self.e_proj.data = src.get(p + "e_proj.weight")
        self.h_proj.data = src.get(p + "h_proj.weight")
        self.block.load(src, p)
        self.hc_head.load(src, p + "hc_head_")

    @staticmethod
    def pool_spec(cfg: ModelConfig) -> PoolSpec:
        assert cfg.v4 is not None
        return PoolSpec(1, "latent", latent_dim=cfg.v4.attn.row("sliding"))

    @torch.inference_mode()
    def forward(self, target: DeepseekV4ForCausalLM, batch: ForwardBatch, hidden: torch.Tensor,
                pool: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """``batch.input_ids`` the tokens t[i+1], ``hidden`` ``[T, n, H]`` the streams h[i] →
        (float32 logits for ``batch.logits_idx`` (all rows when None), its own streams)."""
        e = F.linear(rms_norm(F.embedding(batch.input_ids, target.embed), self.enorm, self.eps), self.e_proj)
        x = e.unsqueeze(1) + F.linear(rms_norm(hidden, self.hnorm, self.eps), self.h_proj)
        x = self.block(x, batch, pool, target.ropes)
        rows = x if batch.logits_idx is None else x.index_select(0, batch.logits_idx)
        head = target.embed if target.lm_head is None else target.lm_head
        return F.linear(rms_norm(self.hc_head(rows), self.norm, self.eps), head).float(), x


# DeepSeek's own tensor names (how V4 checkpoints are stored, and how transformers writes them back)
# → transformers' module names, which the loader above reads. Applied in order, on the name without
# its leading "model.".
_RENAMES = [(re.compile(a), b) for a, b in (
    (r"\.attn\.", ".self_attn."), (r"\.ffn\.", ".mlp."), (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"^embed\.weight", "embed_tokens.weight"), (r"^head\.weight", "lm_head.weight"),
    (r"^hc_head_fn", "hc_head.hc_fn"), (r"^hc_head_base", "hc_head.hc_base"), (r"^hc_head_scale", "hc_head.hc_scale"),
    (r"\.attn_norm\.", ".input_layernorm."), (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_attn_fn", ".attn_hc.fn"), (r"\.hc_attn_base", ".attn_hc.base"), (r"\.hc_attn_scale", ".attn_hc.scale"),
    (r"\.hc_ffn_fn", ".ffn_hc.fn"), (r"\.hc_ffn_base", ".ffn_hc.base"), (r"\.hc_ffn_scale", ".ffn_hc.scale"),
    (r"\.attn_sink", ".sinks"), (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."), (r"\.norm\.", ".kv_norm."), (r"\.ape", ".position_bias"),
    (r"\.wq_a\.", ".q_a_proj."), (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."), (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."), (r"\.wo_a\.", ".o_a_proj."), (r"\.wo_b\.", ".o_b_proj."), (r"\.q_norm\.", ".q_a_norm."),
    (r"\.gate\.bias", ".gate.e_score_correction_bias"), (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."), (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
)]


_MTP_OWN = re.compile(r"^mtp\.(\d+)\.(e_proj|h_proj|enorm|hnorm|norm|hc_head_)")


def v4_name(name: str) -> str:
    """A V4 checkpoint's tensor name as transformers' module tree names it (the MTP block's
    ``mtp.N.*`` as ``model.mtp.N.*``, its own parts kept, its block's renamed like a layer's)."""
    bare = name.removeprefix("model.")
    if _MTP_OWN.match(bare):
        return "model." + bare
    for pattern, repl in _RENAMES:
        bare = pattern.sub(repl, bare)
    return bare if bare == "lm_head.weight" else "model." + bare


class V4Names(Mapping[str, torch.Tensor]):
    """A checkpoint's tensors under transformers' names (each still read only when asked for)."""

    def __init__(self, weights: Mapping[str, torch.Tensor]) -> None:
        self._weights = weights
        self._names = {v4_name(k): k for k in weights}

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._weights[self._names[name]]

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)
