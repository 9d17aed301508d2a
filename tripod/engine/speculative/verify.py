"""The acceptance rule every proposer shares.

A verification item is ``[last token, d1 .. dk]`` run in one forward pass with logits at every
position; row j predicts the token after position j. Walking the rows in order:

- deterministic drafts (n-gram, grammar, greedy or seeded draft models): row j is sampled
  exactly as plain decoding would sample it (same grammar mask, penalties, bias, and the same
  random stream), and the draft continues only while the sampled token equals d(j+1). The
  output is therefore token for token that of plain decoding (greedy and seeded alike), only in
  fewer passes.
- sampled drafts (a draft model drawing from its distribution q without a seed): the standard
  rejection rule, accept d with probability min(1, p(d)/q(d)), else draw from the normalised
  residual max(p - q, 0); the tokens are distributed exactly as the model's own samples.

Either way a verification yields at least one token (the row after the last accepted draft is
always sampled), stops at a stop token or length limit inside the run, and never emits more than
``max_tokens``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from tripod.engine.request import FinishReason, Req, TokenLogprob
from tripod.engine.sampler import Sampler


@dataclass(slots=True)
class Verdict:
    tokens: list[int] = field(default_factory=list)  # appended to the request's output
    logprobs: list[TokenLogprob] = field(default_factory=list)
    accepted: int = 0  # draft tokens kept
    reason: FinishReason | None = None


def accept(
    req: Req,
    draft: list[int],
    draft_probs: torch.Tensor | None,
    logits: torch.Tensor,
    sampler: Sampler,
    apply_mask: Callable[[torch.Tensor, Any], None],
    stop_reason: Callable[[Req, int], FinishReason | None],
) -> Verdict:
    """Decide the tokens of one verification (``logits``: ``len(draft) + 1`` rows), appending
    them to ``req.output_ids`` (and its matcher) as plain decoding would."""
    out = Verdict()
    rejection = draft_probs is not None and not req.params.greedy and req.noise_key is None
    for j in range(len(draft) + 1):
        row = logits[j : j + 1]
        if req.matcher is not None:
            apply_mask(row, req.matcher)
        lp: TokenLogprob | None
        if rejection and j < len(draft):
            tok, lp = _rejection_sample(req, draft[j], draft_probs[j], row, sampler)
        else:
            res = sampler.sample(row, [req])
            tok, lp = res.token_ids[0], res.logprobs[0]
        if req.matcher is not None and not req.matcher.accept_token(tok):
            # NOTE: the grammar allowed no token at all (see Engine.step): the caller's constraint.
            assert not torch.isfinite(row).any(), f"{req.rid}: the grammar refused sampled token {tok}"
            req.error = (f"the output constraint allows no token at output position {len(req.output_ids)}: what "
                         "it requires next cannot be written with this model's vocabulary; change the constraint")
            out.reason = FinishReason.REJECTED
            break
        if not req.output_ids and req.first_token_time is None:
            req.first_token_time = time.monotonic()
        req.output_ids.append(tok)
        out.tokens.append(tok)
        if lp is not None:
            req.output_logprobs.append(lp)
            out.logprobs.append(lp)
        out.reason = stop_reason(req, tok)
        if out.reason is not None or j == len(draft) or tok != draft[j]:
            break
        out.accepted += 1
    return out


def _rejection_sample(
    req: Req, d: int, q: torch.Tensor, row: torch.Tensor, sampler: Sampler
) -> tuple[int, TokenLogprob | None]:
    adjusted = sampler.adjust(row, [req])
    p = sampler.probs(adjusted, [req])[0]
    p = p / p.sum()
    # NOTE: q[d] > 0 (d was drawn from q), so this accepts with probability min(1, p(d)/q(d)).
    if sampler.uniform() * float(q[d]) <= float(p[d]):
        tok = d
    else:
        residual = (p - q).clamp_min(0.0)
        tok = sampler.draw(residual if float(residual.sum()) > 0.0 else p)
    return tok, sampler.logprobs(adjusted, [req], [tok])[0]
