"""Prompt logprobs (``SamplingParams.prompt_logprobs``): the logprob of every prompt token, from
a forward pass of its own over the prompt into scratch KV slots, outside any step.

A step's prefill never computes logits at every prompt position (and a cached prefix is never
recomputed), so this separate pass keeps the step path untouched.
"""

from __future__ import annotations

import torch

from tripod.engine.model_runner import ModelRunner
from tripod.engine.request import Req, TokenLogprob
from tripod.layers.lora import LoraAdapter
from tripod.layers.topk import topk_by_position
from tripod.memory.kv_pool import SlotAllocator
from tripod.memory.prefix_cache import PrefixCache


def score_prompt(req: Req, runner: ModelRunner, allocator: SlotAllocator, cache: PrefixCache, chunk: int,
                 lora: LoraAdapter | None = None) -> bool:
    """Set ``req.prompt_logprobs`` (the first token has none: no context scores it), using
    scratch KV slots freed at once; False when the slots are not to be had now."""
    ids = req.prompt_ids
    # (data-parallel attention: scored on rank 0, in its pool)
    if allocator.free_on(0) < len(ids):
        cache.evict(len(ids) - allocator.free_on(0), 0)
    slots = allocator.alloc(len(ids), 0)
    if slots is None:
        return False
    k = req.params.prompt_logprobs or 0
    out: list[TokenLogprob | None] = [None]
    try:
        for s, logits in runner.prompt_logits(ids, slots, chunk, lora):
            m = min(logits.shape[0], len(ids) - 1 - s)  # rows that predict a prompt token
            if m <= 0:
                continue
            lp = torch.log_softmax(logits[:m], dim=-1)
            target = torch.tensor(ids[s + 1 : s + 1 + m], device=lp.device)
            chosen = lp.gather(1, target.unsqueeze(1)).squeeze(1).tolist()
            tops: list[list[tuple[int, float]]] = [[] for _ in range(m)]
            if k:
                vals, idx = topk_by_position(lp, k)
                tops = [list(zip(i, v, strict=True)) for i, v in zip(idx.tolist(), vals.tolist(), strict=True)]
            out.extend(TokenLogprob(ids[s + 1 + j], chosen[j], tops[j]) for j in range(m))
    finally:
        allocator.free(slots)
    req.prompt_logprobs = out
    return True
