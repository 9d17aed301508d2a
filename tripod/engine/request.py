"""The engine's nouns: sampling parameters, requests, outputs.

Everything here speaks token ids; text lives in the server (and, for the offline API, in
``Engine``'s thin decoding layer).
"""

from __future__ import annotations

import enum
import itertools
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tripod.engine.radix_cache import TreeNode

_MAX_TOP_LOGPROBS = 20


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS or a stop token id
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # cancelled by the caller (client went away)
    ERROR = "error"  # could not be served; ``Req.error`` says why
    REJECTED = "rejected"  # the request itself is invalid (e.g. its grammar); ``Req.error`` says why


@dataclass(slots=True)
class SamplingParams:
    """How to pick each next token and when to stop. Validated on construction.

    ``temperature == 0`` means greedy. ``top_k == -1`` (or 0) disables top-k. Penalties follow
    OpenAI (``frequency_penalty``/``presence_penalty`` on generated tokens) and HF
    (``repetition_penalty`` on prompt and generated tokens).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    logprobs: int | None = None  # None: no logprobs; k >= 0: the chosen token's plus top-k
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1
    priority: int = 0  # higher is served first
    # A ``structured.GrammarSpec``: the output must match it (None: unconstrained).
    grammar: Any = None

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{name} {why} (got {getattr(self, name)!r})")

        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise bad("max_tokens", "must be an integer >= 1")
        if not _finite(self.temperature) or not 0.0 <= self.temperature <= 100.0:
            raise bad("temperature", "must be between 0 and 100")
        if not _finite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise bad("top_k", "must be -1 (disabled), 0 (disabled) or a positive integer")
        if not _finite(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if not _finite(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 10.0:
            raise bad("repetition_penalty", "must be in (0, 10]")
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            if not _finite(v) or not -2.0 <= v <= 2.0:
                raise bad(name, "must be between -2 and 2")
        if self.seed is not None and not _is_int(self.seed):
            raise bad("seed", "must be an integer")
        if self.logprobs is not None and (
            not _is_int(self.logprobs) or not 0 <= self.logprobs <= _MAX_TOP_LOGPROBS
        ):
            raise bad("logprobs", f"must be an integer between 0 and {_MAX_TOP_LOGPROBS}")
        if not _is_int(self.n) or not 1 <= self.n <= 128:
            raise bad("n", "must be an integer between 1 and 128")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative integers")
        if not _is_int(self.priority):
            raise bad("priority", "must be an integer")
        if self.grammar is not None:
            from tripod.engine.structured import GrammarSpec

            if not isinstance(self.grammar, GrammarSpec):
                raise bad("grammar", "must be a GrammarSpec or None")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )


def _is_int(x: object) -> bool:
    # NOTE: bool is an int subclass; ``logprobs=True`` (OpenAI's boolean flag) or
    # ``max_tokens=True`` must be refused, not read as 1.
    return isinstance(x, int) and not isinstance(x, bool)


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


_rid_counter = itertools.count()


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), best first


@dataclass(slots=True, eq=False)
class Req:
    """One sequence inside the engine: its tokens, its KV slots and its progress.

    KV slots: ``slots[i]`` holds the K/V of ``all_ids[i]``. ``slots[:cache_len]`` belong to
    the radix tree (pinned through ``last_node``'s lock); ``slots[cache_len:]`` are this
    request's private tail.
    """

    prompt_ids: list[int]
    params: SamplingParams
    seq: int = field(default_factory=lambda: next(_rid_counter))  # admission tie-breaks
    rid: str = ""
    arrival: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    # NOTE: bumped by every edit of ``slots`` other than an append (the prefix cache swapping in
    # its own slots, a release, unused draft slots given back): kernels read slots through a
    # table that copies appends lazily and rewrites a row when this changes (memory/slot_table).
    slots_version: int = 0
    cache_len: int = 0  # slots owned by the tree (and locked via last_node)
    last_node: TreeNode | None = None
    computed: int = 0  # tokens of all_ids whose KV is in slots
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (first admission)
    finish_reason: FinishReason | None = None
    error: str | None = None
    # n > 1: siblings wait until the first copy has put the prompt into the cache.
    wait_for: Req | None = None
    retractions: int = 0
    first_token_time: float | None = None
    finish_time: float | None = None
    # Per-request sampling state (generator for seeded sampling, token counts for penalties).
    generator: Any = None
    eos_ids: frozenset[int] = frozenset()
    max_len: int = 0  # hard cap on len(all_ids), from the model's context
    index: int = 0  # which of the n copies
    group: str = ""  # the id the caller gave (shared by the n copies)
    # Structured outputs: an XGrammar matcher that has accepted exactly ``output_ids``.
    matcher: Any = None
    # Jump-forward: grammar-forced tokens to verify in the next forward pass.
    draft: list[int] = field(default_factory=list)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def __post_init__(self) -> None:
        if not self.rid:
            self.rid = f"req-{self.seq}"

    def __repr__(self) -> str:
        return (
            f"Req({self.rid}, prompt={len(self.prompt_ids)}, out={len(self.output_ids)}, "
            f"computed={self.computed}, cache_len={self.cache_len})"
        )


@dataclass(slots=True)
class RequestOutput:
    """What ``Engine.generate`` returns for each prompt (one per copy when n > 1)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    cached_tokens: int
    logprobs: list[TokenLogprob] | None = None
    index: int = 0
    error: str | None = None

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(slots=True)
class StreamDelta:
    """One increment of a streamed request: new tokens (and text) since the last delta."""

    request_id: str
    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    cached_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None
