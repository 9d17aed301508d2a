"""What a proposer is: something that guesses a request's next tokens before the model runs.

Proposals are checked by the model in the request's next forward pass (``verify.py``), so a
proposer can only change speed, never the output. A deterministic proposal (n-gram, grammar,
a greedy or seeded draft) carries tokens only; a draft model that *sampled* its tokens also
carries its distribution at each of them, for the rejection-sampling rule.

A multi-token-prediction module (DeepSeek-V3's ``num_nextn_predict_layers``, ``mtp.py``) is one
more ``Proposer`` with ``writes_kv = True`` and ``reads_hidden = True``: after every forward the
engine hands it the target's last hidden states (``observe_hidden``), which it drafts from.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tripod.engine.request import Req
    from tripod.engine.scheduler import ScheduledItem


@dataclass(slots=True)
class Proposal:
    tokens: list[int]
    # [len(tokens), V] float32, rows summing to 1: the distribution each token was drawn from
    # (None: deterministic; the plain-sampling acceptance rule applies).
    probs: Any = None


class Proposer(abc.ABC):
    """Guesses continuations for a batch of requests.

    ``writes_kv``: the proposer runs a model over the draft positions, so the speculator
    allocates the request's draft KV slots (``req.slots`` grows by ``lengths[i]``) *before*
    ``propose`` and the proposal must have exactly that many tokens (or be None, and the
    speculator frees them).
    """

    name: str = ""
    writes_kv: bool = False
    # A model-running proposer's mean draft-pass time per request in its last proposal, for the
    # adaptive policy's cost model (the speculator reads it once and clears it).
    last_pass_seconds: float | None = None
    reads_hidden: bool = False  # wants observe_hidden after every forward

    def observe_hidden(self, item_rows: list[tuple[ScheduledItem, int]], hidden: Any) -> None:
        """The target's last hidden states ``[T, H]`` of a step (``item_rows``: each scheduled
        item and its first row). Only called when ``reads_hidden``."""
        raise NotImplementedError

    @abc.abstractmethod
    def propose(self, reqs: list[Req], lengths: list[int], items: list[ScheduledItem]) -> list[Proposal | None]:
        """Up to ``lengths[i]`` tokens that may follow ``reqs[i].all_ids``. ``items`` is the
        whole step (a draft model keeps its own KV in step with the target's prefill chunks)."""
