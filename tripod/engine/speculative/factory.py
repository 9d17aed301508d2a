"""Building the proposer ``EngineConfig.speculative`` names, with what it needs from the engine."""

from __future__ import annotations

from typing import Any

import torch

from tripod.config import EngineConfig, parse_speculative
from tripod.engine.model_runner import ModelRunner
from tripod.engine.sampler import Sampler
from tripod.engine.speculative.draft_model import DraftModelProposer
from tripod.engine.speculative.mtp import MTPProposer
from tripod.engine.speculative.ngram import NgramProposer
from tripod.engine.speculative.proposer import Proposer
from tripod.loader import LoadedModel, load_model
from tripod.memory.kv_pool import Pool, PoolSpec
from tripod.models.config import ModelConfig
from tripod.models.deepseek import MTPModule
from tripod.models.deepseek_v4 import V4MTP


def load_draft(config: EngineConfig, target: LoadedModel, dtype: torch.dtype, device: torch.device) -> LoadedModel | None:
    """The ``draft:PATH`` model (None for other methods), checked to share the target's
    tokenizer token for token; ``self:K`` is checked against the target's depth."""
    if config.speculative is None:
        return None
    spec = parse_speculative(config.speculative)
    layers = target.config.num_layers
    if spec.kind == "self" and spec.layers >= layers:
        raise ValueError(
            f"self:{spec.layers} asks for {spec.layers} layers but the model has {layers}; "
            f"use self:K with K in [1, {layers - 1}]"
        )
    if spec.kind == "mtp":
        mtp_module(target)  # raises when the checkpoint has none
    if spec.kind != "draft":
        return None
    draft = load_model(spec.path, dtype, device)
    mc, dc = target.config, draft.config
    if dc.vocab_size != mc.vocab_size or draft.tokenizer.get_vocab() != target.tokenizer.get_vocab():
        raise ValueError(
            f"the draft model {draft.name} does not share {target.name}'s tokenizer "
            f"(vocabularies of {dc.vocab_size} and {mc.vocab_size} tokens, or different tokens); "
            "a draft must tokenize exactly like the model it drafts for"
        )
    if dc.hybrid is not None:
        # (its proposer's runner keeps K/V only: the draft's own linear layers would have no states)
        raise ValueError(f"the draft model {draft.name} is a hybrid linear-attention model ({dc.architecture}); "
                         "a draft must be a model with attention layers only")
    return draft


def make_proposer(
    config: EngineConfig,
    target: LoadedModel,
    draft: LoadedModel | None,
    pool: Pool,
    sampler: Sampler,
    *,
    path: str,
    max_len: int,
    device: torch.device,
    dtype: torch.dtype,
    **_: Any,
) -> Proposer | None:
    """The configured proposer. Draft models get a model runner of their own: ``self:K`` over
    the target's pool (its layers are the target's first K), ``draft:PATH`` over a pool of its
    own with the target's slot ids (``pool.num_slots``)."""
    if config.speculative is None:
        return None
    spec = parse_speculative(config.speculative)
    if spec.kind == "ngram":
        return NgramProposer()
    if spec.kind == "mtp":
        model = mtp_module(target)
        own = mtp_pool_spec(target.config).make(pool.num_slots, dtype, device)
        return MTPProposer(model, own, sampler, catch_up=config.chunk_size)  # type: ignore[arg-type]
    if spec.kind == "self":
        view = target.model.truncated(spec.layers)
        runner = ModelRunner(view, pool, device, use_mirror=False, path=path, max_len=max_len,
                             stored=config.weights == "stored", level=config.kernel_level)
        return DraftModelProposer("self", runner, sampler, shares_kv=True, catch_up=config.chunk_size)
    assert draft is not None
    dc = draft.config
    own = dc.pool_spec().make(pool.num_slots, dtype, device)
    runner = ModelRunner(draft.model, own, device, use_mirror=False, path=path, max_len=max_len,
                         level=config.kernel_level)
    return DraftModelProposer("draft", runner, sampler, shares_kv=False, catch_up=config.chunk_size)


def mtp_pool_spec(cfg: ModelConfig) -> PoolSpec:
    """The MTP layer's own one-layer pool (at the target's slot ids)."""
    return V4MTP.pool_spec(cfg) if cfg.v4 is not None else MTPModule.pool_spec(cfg)


def mtp_module(target: LoadedModel) -> torch.nn.Module:
    """The target model (with its MTP module loaded), or why ``mtp`` cannot run on it."""
    model = target.model
    if getattr(model, "mtp", None) is None:
        raise ValueError(
            f"--speculative mtp needs a multi-token-prediction module in the checkpoint "
            f"(num_nextn_predict_layers and DeepSeek-V3's model.layers.N.* or V4's mtp.0.* tensors); {target.name} has none"
        )
    return model


def extra_bytes_per_token(config: EngineConfig, target: LoadedModel, dtype: torch.dtype) -> int:
    """KV bytes per token slot a proposer adds to the target's (the MTP layer's latent)."""
    if config.speculative is not None and parse_speculative(config.speculative).kind == "mtp":
        return mtp_pool_spec(target.config).bytes_per_token(dtype)
    return 0
