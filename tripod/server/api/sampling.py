"""Request → ``SamplingParams``: the one translation every API surface goes through.

Each API (OpenAI chat, OpenAI completions, Anthropic messages) names its parameters its own way;
it hands ``build_sampling`` the ``SamplingParams`` fields it has, and the names its caller used
for them. The value bounds are ``SamplingParams``' own (``tripod/protocol/sampling.py``):
constructing it here is the check, and the engine process receives this very object
(``tripod.protocol.engine_ipc.AddRequest``). What
only the server knows is checked here too (``state.Limits``): the context left for the output,
``--max-n``, the vocabulary, and what JSON integers the wire allows.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from tripod.protocol.sampling import GrammarSpec, SamplingParamError, SamplingParams
from tripod.server.errors import APIError
from tripod.server.state import Limits

MAX_STOP = 16
MAX_STOP_LEN = 256


def build_sampling(
    limits: Limits,
    *,
    prompt_len: int,
    max_tokens: int | None,
    default_max_tokens: int,
    names: Mapping[str, str] | None = None,
    prompt_param: str = "prompt",
    grammar: GrammarSpec | None = None,
    prompt_note: str = "",
    **fields: Any,
) -> SamplingParams:
    """``fields`` are ``SamplingParams`` fields (None: the default). ``names`` maps a field to the
    name the caller used (``{"max_tokens": "max_completion_tokens"}``), so errors name the
    caller's parameter; ``prompt_note`` follows the prompt's length in them (what of it is images).
    Raises ``APIError`` (400) saying what to change."""
    names = names or {}

    def bad(field: str, why: str, value: Any) -> APIError:
        name = names.get(field, field)
        return APIError(400, f"'{name}' {why} (got {value!r})", param=name)

    given = {k: v for k, v in fields.items() if v is not None}
    _check_server_limits(limits, given, bad)
    max_tokens = _max_tokens(limits, prompt_len, max_tokens, default_max_tokens,
                             names.get("max_tokens", "max_tokens"), prompt_param, prompt_note)
    try:
        return SamplingParams(max_tokens=max_tokens, grammar=grammar, **given)
    except SamplingParamError as e:
        raise bad(e.param, e.why, e.value) from None


def _check_server_limits(limits: Limits, given: dict[str, Any], bad: Callable[[str, str, Any], APIError]) -> None:
    """What only the server knows: ``--max-n``, the vocabulary, and the integers the wire allows.
    (Values of the wrong type are left to ``SamplingParams``, which names them.)"""
    n = given.get("n", 1)
    if isinstance(n, int) and not 1 <= n <= limits.max_n:
        raise bad("n", f"must be between 1 and {limits.max_n}", n)
    seed = given.get("seed")
    if isinstance(seed, int) and not -(2**63) <= seed < 2**63:
        raise bad("seed", "must fit in 64 bits", seed)
    priority = given.get("priority", 0)
    if isinstance(priority, int) and not -(2**31) <= priority < 2**31:
        raise bad("priority", "must fit in 32 bits", priority)
    top_k = given.get("top_k")
    if isinstance(top_k, int) and top_k > limits.vocab_size:
        raise bad("top_k", f"must be at most the vocabulary size {limits.vocab_size}", top_k)
    for field in ("stop_token_ids", "logit_bias"):
        ids = list(given.get(field) or ())
        if any(isinstance(t, int) and not 0 <= t < limits.vocab_size for t in ids):
            raise bad(field, f"must name token ids in [0, {limits.vocab_size})", given[field])


def _max_tokens(limits: Limits, prompt_len: int, max_tokens: int | None, default: int, mt: str,
                prompt_param: str, note: str = "") -> int:
    """The output's token budget checked against the context the prompt leaves (``mt``: the
    caller's name for it). None given: ``default``, as far as the context allows."""
    room = limits.max_len - prompt_len
    if room < 1:
        raise APIError(
            400,
            f"the prompt has {prompt_len} tokens{note} but this model's context allows at most "
            f"{limits.max_len - 1} prompt tokens ({limits.max_len} in all, with at least one generated); "
            f"shorten the prompt{' or send fewer or smaller images' if note else ''}",
            param=prompt_param, code="context_length_exceeded",
        )
    if max_tokens is None:
        return min(default, room)
    if isinstance(max_tokens, int) and max_tokens < 1:
        raise APIError(400, f"'{mt}' must be >= 1 (got {max_tokens})", param=mt)
    if isinstance(max_tokens, int) and max_tokens > room:
        raise APIError(
            400,
            f"'{mt}' is {max_tokens} but the prompt has {prompt_len} tokens{note} and the context "
            f"is {limits.max_len}, leaving room for at most {room}; lower {mt} or shorten the prompt",
            param=mt, code="context_length_exceeded",
        )
    return max_tokens


def stop_strings(stop: str | list[str] | None, param: str = "stop") -> list[str]:
    """Stop strings as a checked list."""
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop)
    if len(stops) > MAX_STOP:
        raise APIError(400, f"'{param}' may hold at most {MAX_STOP} strings (got {len(stops)})", param=param)
    for s in stops:
        if not s:
            raise APIError(400, f"'{param}' strings must not be empty", param=param)
        if len(s) > MAX_STOP_LEN:
            raise APIError(400, f"'{param}' strings must be at most {MAX_STOP_LEN} characters", param=param)
    return stops


def logit_bias_ids(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's ``logit_bias`` (token ids as JSON object keys) → ``{token id: bias}``."""
    if not bias:
        return None
    out: dict[int, float] = {}
    for k, v in bias.items():
        try:
            tid = int(k)
        except ValueError:
            raise APIError(400, f"'logit_bias' keys must be token ids (got {k!r})", param="logit_bias") from None
        out[tid] = v
    return out
