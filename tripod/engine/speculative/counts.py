"""Speculation counters, per proposer (the engine's stats; Prometheus names follow vLLM's)."""

from __future__ import annotations

from dataclasses import dataclass

PROPOSERS = ("ngram", "draft", "self", "mtp", "jump_forward")


@dataclass(slots=True)
class SpecCounts:
    """Cumulative, for one proposer: verification rounds that carried a draft, draft tokens
    sent for verification, and of those the tokens accepted (each saves one forward pass)."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verification round: accepted drafts plus the one the target samples."""
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else 0.0
