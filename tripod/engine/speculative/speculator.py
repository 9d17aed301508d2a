"""The speculator: between the scheduler and the forward pass it turns decode items into
verification items carrying drafts, and after the pass it accepts what the model agrees with.

Per step: every decode item whose request may speculate gets a draft, from the grammar when the
grammar forces text (jump-forward), else from the configured proposer; the draft's KV slots are
allocated onto the request (they are the slots the forward verifies the draft in), and the item
becomes ``[last token, draft...]`` with logits at every position. After the forward,
``verify.accept`` picks the tokens and the slots of rejected positions go back to the allocator
at once (the request is left exactly as plain decoding would leave it: every token but the last
has K/V). On a hybrid model the slot's recurrent state is put back to the state after the last
kept row (``StateTrace``: the mixers kept it for every verified row).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from tripod.config import EngineConfig
from tripod.engine.request import Req
from tripod.engine.sampler import Sampler
from tripod.engine.scheduler import ScheduledItem
from tripod.engine.speculative.adaptive import AdaptivePolicy
from tripod.engine.speculative.counts import SpecCounts
from tripod.engine.speculative.grammar import GrammarProposer
from tripod.engine.speculative.proposer import Proposal, Proposer
from tripod.engine.speculative.verify import Verdict, accept

if TYPE_CHECKING:
    from tripod.memory.kv_pool import SlotAllocator
    from tripod.memory.state_pool import StateTrace

class Speculator:
    """Owns the proposers, the adaptive policy and the per-proposer counters."""

    def __init__(
        self,
        config: Callable[[], EngineConfig],
        tokenizer: Any,
        allocator: SlotAllocator,
        sampler: Sampler,
        counts: dict[str, SpecCounts],
        proposer: Proposer | None,
    ) -> None:
        self._config = config  # the engine's current config (tests and operators may swap it)
        self.allocator = allocator
        self.sampler = sampler
        self.counts = counts
        self.grammar = GrammarProposer(tokenizer)
        self.proposer = proposer
        self.policy = AdaptivePolicy(config().num_draft_tokens, config().spec_max_batch, config().spec_adaptive)
        self.trace: StateTrace | None = None  # the last forward's (a hybrid model's verify rows)

    @property
    def config(self) -> EngineConfig:
        return self._config()

    def attach(self, items: list[ScheduledItem], budget: int) -> list[ScheduledItem]:
        """Give drafts to the decode items that speculate this step (at most ``budget`` draft
        tokens in all); returns them, now verification items."""
        cfg = self.config
        pol = self.policy
        pol.max_k, pol.max_batch, pol.adaptive = cfg.num_draft_tokens, cfg.spec_max_batch, cfg.spec_adaptive
        name = self.proposer.name if self.proposer is not None else ""
        # NOTE: only requests that have sampled a token: a one-token last prefill chunk (the rest
        # of the prompt cached) also ends at seq_len - 1, but its step must run the prompt's own
        # bookkeeping (prefix insertion, first-token accounting) in Engine.step.
        decodes = [it for it in items if it.length == 1 and it.start == it.req.seq_len - 1 and it.req.output_ids]
        step_ok = self.proposer is not None and pol.step_allows(len(decodes))
        # The batch the requests decode in: this step's decodes and prefills (a step of prompts
        # only is followed by their decodes together).
        batch = len({id(it.req) for it in items})
        forced: list[tuple[ScheduledItem, int]] = []
        wanted: list[tuple[ScheduledItem, int]] = []
        for it in decodes:
            req = it.req
            room = min(req.params.max_tokens - len(req.output_ids), req.max_len - req.seq_len) - 1
            if room <= 0:
                continue
            if req.matcher is not None and cfg.jump_forward:
                forced.append((it, min(room, cfg.max_jump_forward)))
            elif step_ok and req.params.speculative:
                k = pol.plan(pol.state(req, name, batch), name, batch)
                if k > 0:
                    wanted.append((it, min(room, k)))
        out: list[ScheduledItem] = []
        if forced:
            props = self.grammar.propose([it.req for it, _ in forced], [k for _, k in forced], items)
            left: list[tuple[ScheduledItem, int]] = []
            for (it, k), p in zip(forced, props, strict=True):
                if p is not None:
                    budget = self._attach(it, p, self.grammar.name, budget, out)
                elif step_ok and it.req.params.speculative:  # nothing forced: the proposer may guess
                    kk = pol.plan(pol.state(it.req, name, batch), name, batch)
                    if kk > 0:
                        left.append((it, min(k, kk)))
            wanted = left + wanted
        if wanted and self.proposer is not None and budget > 0:
            self._propose(wanted, items, budget, out)
        elif step_ok and self.proposer is not None and self.proposer.writes_kv and pol.pays(name, batch):
            # Nobody proposes this step, but a separate draft keeps pace with prefill chunks
            # (while it pays: otherwise a request catches up if and when it proposes).
            self.proposer.propose([], [], items)
        return out

    def _propose(
        self, wanted: list[tuple[ScheduledItem, int]], items: list[ScheduledItem], budget: int, out: list[ScheduledItem]
    ) -> None:
        """Ask the configured proposer for drafts for ``wanted`` within ``budget`` draft tokens."""
        proposer = self.proposer
        assert proposer is not None
        chosen: list[tuple[ScheduledItem, int]] = []
        for it, k in wanted:
            k = min(k, budget)
            if k <= 0:
                break
            if proposer.writes_kv:
                slots = self.allocator.alloc(k, it.req.dp_rank)
                if slots is None:  # no spare KV: decode plainly this step
                    continue
                it.req.slots.extend(slots)
            chosen.append((it, k))
            budget -= k
        if not chosen:
            return
        t0 = time.perf_counter()
        props = proposer.propose([it.req for it, _ in chosen], [k for _, k in chosen], items)
        spent = time.perf_counter() - t0
        self.policy.total_seconds += spent
        if all(it.req.spec is not None and it.req.spec.probing for it, _ in chosen):
            self.policy.explore_seconds += spent
        for (it, k), p in zip(chosen, props, strict=True):
            req = it.req
            if proposer.writes_kv:
                if p is None:  # the draft could not propose (catching up): give the slots back
                    self._trim(req, len(req.slots) - k)
                    continue
                req.draft, req.draft_source, req.draft_probs = p.tokens, proposer.name, p.probs
                self._mark(it, proposer.name)
                out.append(it)
            elif p is not None:
                budget = self._attach(it, p, proposer.name, budget + k, out)
            else:
                budget += k

    def _attach(self, it: ScheduledItem, p: Proposal, name: str, budget: int, out: list[ScheduledItem]) -> int:
        """Allocate a deterministic proposal's KV slots and make ``it`` its verification."""
        toks = p.tokens[: max(0, budget)]
        if not toks:
            return budget
        slots = self.allocator.alloc(len(toks), it.req.dp_rank)
        if slots is None:
            return budget
        req = it.req
        req.slots.extend(slots)
        req.draft, req.draft_source, req.draft_probs = toks, name, None
        self._mark(it, name)
        out.append(it)
        return budget - len(toks)

    def _mark(self, it: ScheduledItem, name: str) -> None:
        req = it.req
        req.output_ids.extend(req.draft)  # in all_ids for the forward only (see Engine.step)
        it.length = 1 + len(req.draft)
        it.verify = True
        c = self.counts.setdefault(name, SpecCounts())
        c.drafts += 1
        c.draft_tokens += len(req.draft)

    def after_forward(self, batch: Any, hidden: torch.Tensor | None) -> None:
        """Hand the step's last hidden states to a proposer that reads them (MTP); keep a hybrid
        model's per-row states of the step's verify items until they are judged (``verify``)."""
        self.trace = batch.states.trace if getattr(batch, "states", None) is not None else None
        if hidden is not None and self.proposer is not None and self.proposer.reads_hidden:
            self.proposer.observe_hidden(batch.item_rows, hidden)

    def observe_step(self, rows: int, seconds: float, decode_only: bool) -> None:
        """The target's forward time of a step of ``rows`` tokens: decode steps (verification
        rows included) fit the step-time line; a draft model's pass is measured by it."""
        self.policy.total_seconds += seconds
        if decode_only:
            self.policy.observe_step(rows, seconds)
        p = self.proposer
        if p is not None and p.last_pass_seconds is not None:
            self.policy.observe_pass(p.name, p.last_pass_seconds)
            p.last_pass_seconds = None

    def _trim(self, req: Req, keep: int) -> None:
        """Give back ``req``'s slots from ``keep`` on (draft positions the target won't keep)."""
        extra = req.slots[keep:]
        del req.slots[keep:]
        req.slots_version += 1
        self.allocator.free(extra)

    def verify(self, it: ScheduledItem, logits: torch.Tensor, apply_mask: Any, stop_reason: Any) -> Verdict:
        """Accept the draft of verification item ``it`` from its rows of ``logits``; the KV of
        rejected positions is freed."""
        req = it.req
        draft, probs, name = req.draft, req.draft_probs, req.draft_source
        req.draft, req.draft_probs, req.draft_source = [], None, ""
        start = req.seq_len  # index of the first token this step decides
        verdict = accept(req, draft, probs, logits, self.sampler, apply_mask, stop_reason)
        # Tokens [0, start + len(new) - 1) have valid KV; the last new token has none yet
        # (exactly the state plain decoding leaves). Unused draft slots go back.
        req.computed = start + len(verdict.tokens) - 1
        self._trim(req, req.computed)
        if self.trace is not None:  # a hybrid: every linear layer's state back to the last kept row
            assert req.state_slot is not None
            self.trace.settle(req.state_slot, req.computed - it.start)
        self.counts.setdefault(name, SpecCounts()).accepted_tokens += verdict.accepted
        if name != self.grammar.name and req.spec is not None:
            self.policy.update(req.spec, name, len(draft), verdict.accepted)
        return verdict
