"""The engine's nouns: sampling parameters, requests, outputs.

Everything here speaks token ids; text lives in the server (and, for the offline API, in
``Engine``'s thin decoding layer). ``SamplingParams``, ``GrammarSpec`` and ``Resume`` cross the
server → engine pipe and are defined in ``tripod.protocol.sampling``; they are named here too.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from tripod.engine.images import PromptImages
from tripod.engine.lora import LoraHandle
from tripod.layers.lora import LoraAdapter
from tripod.memory.prefix_cache import TreeNode, namespaced_key

# The sampling parameters cross the server → engine pipe, so they are protocol types; the engine
# and the offline API name them from here.
from tripod.protocol.sampling import (  # noqa: F401 (re-exported)
    GRAMMAR_KINDS,
    LOGIT_BIAS_RANGE,
    MAX_LOGIT_BIAS,
    MAX_N,
    MAX_TOP_LOGPROBS,
    PENALTY_RANGE,
    REPETITION_PENALTY_MAX,
    TEMPERATURE_MAX,
    GrammarSpec,
    Resume,
    SamplingParamError,
    SamplingParams,
)


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS or a stop token id
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # cancelled by the caller (client went away)
    ERROR = "error"  # could not be served; ``Req.error`` says why
    REJECTED = "rejected"  # the request itself is invalid (e.g. its grammar); ``Req.error`` says why


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
    dp_rank: int = 0  # data-parallel attention: the rank whose pool holds its KV (set when admitted)
    # Hybrid models: its slot in the StatePool (every linear layer's state after ``computed``
    # tokens), held from admission to release; None while it waits.
    state_slot: int | None = None
    # LoRA: the adapter admission resolved (None: the base model), and its resident weights while
    # the request runs (held from the scheduler's admission to its release).
    lora: LoraHandle | None = None
    adapter: LoraAdapter | None = None
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (first admission)
    finish_reason: FinishReason | None = None
    error: str | None = None
    # n > 1: siblings wait until the first copy has put the prompt into the cache.
    wait_for: Req | None = None
    retractions: int = 0
    first_token_time: float | None = None
    finish_time: float | None = None
    # Seeded sampling: the key of this sequence's counter-based noise (sampler.noise_key of the
    # seed and the copy index); None draws from the engine's shared generator.
    noise_key: int | None = None
    eos_ids: frozenset[int] = frozenset()
    max_len: int = 0  # hard cap on len(all_ids), from the model's context
    index: int = 0  # which of the n copies
    group: str = ""  # the id the caller gave (shared by the n copies)
    # Structured outputs: an XGrammar matcher that has accepted exactly ``output_ids``.
    matcher: Any = None
    # Speculative decoding (engine/speculative): tokens proposed for this step's verification,
    # which proposer made them, and (draft models sampling without a seed) the draft's
    # distribution at each of them ``[len(draft), V]`` for the rejection-sampling rule.
    draft: list[int] = field(default_factory=list)
    draft_source: str = ""
    draft_probs: Any = None
    spec: Any = None  # speculative.SpecState: adaptive draft length, the draft model's KV progress
    # params.prompt_logprobs: one entry per prompt token (None for the first), computed before
    # the request is queued and reported with its first output.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_logprobs_reported: bool = False
    # Fair share under contention (engine/fairness.py): the tenant it is charged to and that
    # tenant's weight. "" everywhere: no tenants, today's scheduling.
    tenant: str = ""
    weight: float = 1.0
    # --task embed (engine/pooling.py): what has been pooled of the prompt; such a request samples nothing.
    pooled: Any = None
    # params.return_routed_experts (engine/routed_experts.py): per position, per MoE layer, the
    # top-k expert ids (None: not asked; an entry is None until its position is computed).
    routed: list[Any] | None = None
    # A vision-language model's images of the prompt (engine/images.py; shared by the n copies).
    images: PromptImages | None = None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def cache_ids(self) -> list[int]:
        """``all_ids`` as the prefix cache keys them: in its LoRA adapter's namespace, each image's
        tokens keyed by the image's content (``PromptImages.key``)."""
        namespace = self.lora.namespace if self.lora is not None else 0
        if self.images is None:
            return namespaced_key(self.all_ids, namespace)
        assert namespace == 0, "LoRA adapters are refused on vision-language models"
        return self.images.key + self.output_ids

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
class StepOutput:
    """What one step produced for one request."""

    req: Req
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob] = field(default_factory=list)
    finished: bool = False
    # params.prompt_logprobs: set on the request's first output only.
    prompt_logprobs: list[TokenLogprob | None] | None = None


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
    prompt_logprobs: list[TokenLogprob | None] | None = None  # params.prompt_logprobs
    routed_experts: list[list[list[int]]] | None = None  # params.return_routed_experts

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
    prompt_logprobs: list[TokenLogprob | None] | None = None  # with the first delta
