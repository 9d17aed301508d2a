"""The server's side of the router's failover (``tripod/router/failover.py``).

A request with ``tripod_failover`` gets resume points: each stream chunk that ends an engine
delta carries, per choice, a ``ResumePoint`` under ``"tripod"`` (``mark_choice``); a whole answer
comes as ``progress_stream``'s events (``answer/generation.py``). A request with ``tripod_continuation``
continues another replica's answer: ``resume_priors`` turns it into each choice's ``Prior`` and
the copies the engine still has to run, each from its tokens.
"""

from __future__ import annotations

from typing import Any

import msgspec

from tripod.protocol.engine_ipc import Logprob
from tripod.protocol.failover import ResumePoint
from tripod.protocol.sampling import Resume
from tripod.server.answer.generation import Prior
from tripod.server.api.openai_requests import ChatCompletionRequest, CompletionRequest
from tripod.server.engine_client import EnginePart
from tripod.server.errors import APIError
from tripod.server.state import ServerState, check_ids

_RESUMED_FINISH = ("stop", "length", "tool_calls")


def resume_priors(state: ServerState, req: ChatCompletionRequest | CompletionRequest, parts: list[EnginePart],
                  n: int) -> dict[int, Prior] | None:
    """``tripod_continuation`` → each choice's ``Prior``, and the parts' copies to run (every choice
    that had not finished, from its tokens); None when the request is no continuation."""
    cont = req.tripod_continuation
    if cont is None:
        return None
    where = "tripod_continuation.choices"
    priors: dict[int, Prior] = {}
    for ch in cont.choices:
        if not 0 <= ch.index < len(parts) * n or ch.index in priors:
            raise APIError(400, f"'{where}': choice indices must be distinct and in [0, {len(parts) * n}) "
                           f"(got {ch.index})", param=where)
        check_ids(state, ch.token_ids, f"{where}.token_ids")
        if req.stream and ch.chars is None:
            raise APIError(400, f"'{where}': a continued stream needs each choice's 'chars' (the characters "
                           "of its text the client has)", param=f"{where}.chars")
        if ch.chars is not None and ch.chars < 0:
            raise APIError(400, f"'{where}.chars' must be >= 0 (got {ch.chars})", param=f"{where}.chars")
        if ch.finish_reason is not None and ch.finish_reason not in _RESUMED_FINISH:
            raise APIError(400, f"'{where}.finish_reason' must be one of {', '.join(_RESUMED_FINISH)} or null "
                           f"(got {ch.finish_reason!r})", param=f"{where}.finish_reason")
        lps = _logprobs(ch.logprobs or [])
        if lps is None or (ch.logprobs is not None and len(lps) != len(ch.token_ids)):
            raise APIError(400, f"'{where}.logprobs' must hold one [token id, logprob, [[token id, logprob], ...]] "
                           "per token id", param=f"{where}.logprobs")
        priors[ch.index] = Prior(list(ch.token_ids), ch.chars, lps, ch.finish_reason)
    for pi, p in enumerate(parts):
        p.resume = []
        for i in range(n):
            prior = priors.get(pi * n + i)
            if prior is None or prior.finish_reason is None:
                p.resume.append(Resume(i, tuple(prior.token_ids) if prior else ()))
    return priors


def _logprobs(raw: list[list[Any]]) -> list[Logprob] | None:
    """Raw ``[id, logprob, [[id, logprob], ...]]`` entries checked (every logprob a number), or None."""
    try:
        lps = msgspec.convert(raw, list[Logprob])
    except msgspec.ValidationError:
        return None
    return lps if all(lp.logprob is not None for lp in lps) else None


def mark_choice(choice: dict[str, Any], req: ChatCompletionRequest | CompletionRequest, token_ids: list[int],
                chars: int) -> dict[str, Any]:
    """The extensions a chunk's choice carries: its token ids (``return_token_ids``) and, for the
    router (``tripod_failover``), the resume point after it."""
    if req.return_token_ids:
        choice["token_ids"] = token_ids
    if req.tripod_failover:
        choice["tripod"] = ResumePoint(token_ids, chars).as_json()
    return choice
