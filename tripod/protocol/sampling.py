"""Sampling parameters: how the engine picks each next token and when it stops.

They cross the server → engine pipe inside ``AddRequest`` (``tripod.protocol.engine``), so they
live here, below both; ``tripod.engine.request`` re-exports them for the engine and the offline
API. Built and validated once in the HTTP process (``server/api/sampling.py`` builds a
``SamplingParams``, so it runs this very validation); the engine process decodes the same
dataclasses, and the codec runs ``__post_init__`` again as the backstop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_TOP_LOGPROBS = 20
# The bounds of every sampling parameter, in one place: the server checks requests against these
# (``server/api/sampling.py`` builds a ``SamplingParams``, so it runs this very validation) and the
# engine accepts exactly the same values.
TEMPERATURE_MAX = 2.0
PENALTY_RANGE = (-2.0, 2.0)  # frequency_penalty, presence_penalty (OpenAI's range)
REPETITION_PENALTY_MAX = 10.0
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # OpenAI's range
MAX_LOGIT_BIAS = 1024  # entries per request
MAX_N = 128

GRAMMAR_KINDS = ("json", "regex", "ebnf", "choice", "structural_tag")


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """What the output must match. ``json``: ``value`` is a JSON schema (text), or "" for any
    JSON object; ``regex``/``ebnf``: the pattern/grammar text; ``choice``: a JSON list of strings;
    ``structural_tag``: an XGrammar structural tag (JSON text), e.g. free text with tool calls
    whose bodies follow their schemas once their trigger appears."""

    kind: str
    value: str

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise ValueError(f"grammar kind must be one of {', '.join(GRAMMAR_KINDS)} (got {self.kind!r})")
        if not isinstance(self.value, str):
            raise ValueError(f"grammar value must be a string (got {type(self.value).__name__})")


class SamplingParamError(ValueError):
    """A sampling parameter out of its bounds. ``param`` names the field, ``why`` says what it
    must be; the message is ``"<param> <why> (got <value>)"``."""

    def __init__(self, param: str, why: str, value: object) -> None:
        super().__init__(f"{param} {why} (got {value!r})")
        self.param = param
        self.why = why
        self.value = value


@dataclass(slots=True)
class SamplingParams:
    """How to pick each next token and when to stop. Validated on construction.

    ``temperature == 0`` means greedy. ``top_k == -1`` (or 0) disables top-k. Penalties follow
    OpenAI (``frequency_penalty``/``presence_penalty`` on generated tokens) and HF
    (``repetition_penalty`` on prompt and generated tokens). ``logit_bias`` (token id → bias in
    [-100, 100]) is added to the logits before anything else, as OpenAI defines it.
    ``prompt_logprobs`` (k >= 0) asks for the logprob of every prompt token (the first has none)
    with the top-k alternatives at each position.
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
    # The output must match it (None: unconstrained).
    grammar: GrammarSpec | None = None
    logit_bias: dict[int, float] | None = None
    prompt_logprobs: int | None = None
    # Speculative decoding for this request when the engine has a proposer (False: decode
    # plainly; outputs are the same either way, only the speed differs).
    speculative: bool = True
    # The LoRA adapter to run this request with (its name; None: the base model).
    lora: str | None = None
    # Routing replay (engine/routed_experts.py): the top-k expert ids of every MoE layer at every
    # position the request computes (its prompt and its output but the last token).
    return_routed_experts: bool = False

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> SamplingParamError:
            return SamplingParamError(name, why, getattr(self, name))

        def in_range(name: str, lo: float, hi: float, lo_open: bool = False) -> None:
            v = getattr(self, name)
            if not _finite(v) or v < lo or v > hi or (lo_open and v == lo):
                raise bad(name, f"must be in {'(' if lo_open else '['}{lo:g}, {hi:g}]")

        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise bad("max_tokens", "must be an integer >= 1")
        in_range("temperature", 0.0, TEMPERATURE_MAX)
        in_range("top_p", 0.0, 1.0, lo_open=True)
        if not _is_int(self.top_k) or self.top_k < -1:
            raise bad("top_k", "must be -1 (disabled), 0 (disabled) or a positive integer")
        in_range("min_p", 0.0, 1.0)
        in_range("repetition_penalty", 0.0, REPETITION_PENALTY_MAX, lo_open=True)
        in_range("frequency_penalty", *PENALTY_RANGE)
        in_range("presence_penalty", *PENALTY_RANGE)
        if self.seed is not None and not _is_int(self.seed):
            raise bad("seed", "must be an integer")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or not 0 <= v <= MAX_TOP_LOGPROBS):
                raise bad(name, f"must be an integer between 0 and {MAX_TOP_LOGPROBS}")
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise bad("n", f"must be an integer between 1 and {MAX_N}")
        if not isinstance(self.stop_token_ids, list) or any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative integers")
        if not _is_int(self.priority):
            raise bad("priority", "must be an integer")
        if self.grammar is not None and not isinstance(self.grammar, GrammarSpec):
            raise bad("grammar", "must be a GrammarSpec or None")
        if not isinstance(self.speculative, bool):
            raise bad("speculative", "must be true or false")
        if self.lora is not None and (not isinstance(self.lora, str) or not self.lora):
            raise bad("lora", "must be an adapter's name (a non-empty string) or None")
        if self.logit_bias is not None:
            lb = self.logit_bias
            if not isinstance(lb, dict) or len(lb) > MAX_LOGIT_BIAS:
                raise bad("logit_bias", f"must map at most {MAX_LOGIT_BIAS} token ids to biases")
            lo, hi = LOGIT_BIAS_RANGE
            for k, v in lb.items():
                if not _is_int(k) or k < 0:
                    raise bad("logit_bias", "keys must be token ids (non-negative integers)")
                if not _finite(v) or not lo <= v <= hi:
                    raise bad("logit_bias", f"values must be in [{lo:g}, {hi:g}]")

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


@dataclass(frozen=True, slots=True)
class Resume:
    """One copy of a request continued from the tokens it had generated (elsewhere: the router's
    failover re-issues a request to another replica as a continuation). The engine treats
    ``output_ids`` exactly as if it had generated them itself: penalties count them, the grammar
    matcher is advanced through them, ``max_tokens`` and the seeded noise's position include
    them; only their KV is computed again, like a prompt's."""

    index: int  # which of the request's n copies (its seeded noise stream)
    output_ids: tuple[int, ...]
