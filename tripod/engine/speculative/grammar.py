"""Jump-forward as a proposer: when the grammar forces a continuation (a key name, a bracket),
its tokens are proposed and verified like any draft; the model still picks every token."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tripod.engine.speculative.proposer import Proposal, Proposer

if TYPE_CHECKING:
    from tripod.engine.request import Req
    from tripod.engine.scheduler import ScheduledItem


class GrammarProposer(Proposer):
    name = "jump_forward"

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def propose(self, reqs: list[Req], lengths: list[int], items: list[ScheduledItem]) -> list[Proposal | None]:
        out: list[Proposal | None] = []
        for req, k in zip(reqs, lengths, strict=True):
            forced = req.matcher.find_jump_forward_string() if req.matcher is not None else ""
            toks = list(self.tokenizer.encode(forced, add_special_tokens=False))[:k] if forced else []
            out.append(Proposal(toks) if toks else None)
        return out
