"""Starting a generation, shared by the surfaces that generate: the drain check, the tenant's
limits (``tripod.tenants``), the engine link's admission count (``EngineClient.open``: 429, or the
surface's own overload status), and the first delta, which comes before the response starts.

(This decides whether a request reaches the engine at all; what the engine process does with it
then is the engine's own admission.)
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from tripod import tracing
from tripod.asgi import until_disconnect
from tripod.server.answer.generation import Delta, Generation, Prior
from tripod.server.api.rl import asleep_error
from tripod.server.engine_client import EngineDead, EnginePart, Overloaded, RequestHandle
from tripod.server.errors import APIError
from tripod.server.state import ServerState
from tripod.server.traces import GENERATION_KEY
from tripod.tenants import (
    COUNT_HEADER,
    DEFAULT_TENANT,
    OverLimit,
    RequestRecord,
    Tenant,
    TokenCounts,
    record_of,
)


@dataclass(slots=True)
class Started:
    """A generation whose first delta has come: the caller streams or collects the rest, and
    closes ``handle`` when done (a stream hands that to its response)."""

    handle: RequestHandle
    gen: Generation
    it: AsyncIterator[Delta]
    first: Delta | None


async def start_generation(
    state: ServerState,
    request: Request,
    parts: list[EnginePart],
    stops: list[str],
    arrival: float,
    overload_status: int | None = None,
    priors: dict[int, Prior] | None = None,
    special: bool = False,
) -> Started:
    """Admit ``parts`` and wait for the first delta. The first delta comes before the response
    starts: a request the engine refuses still gets its 4xx status, and a client gone during
    prefill is noticed. ``special``: special tokens stay in the text (``SeqText``)."""
    cfg = state.config
    if state.draining:
        raise APIError(503, "the server is shutting down; retry on another replica", type="server_error",
                       code="draining", headers={"Retry-After": str(cfg.retry_after)})
    asleep = asleep_error(state)
    if asleep is not None:
        raise asleep
    if request.headers.get(COUNT_HEADER) == "count":
        raise AdmissionCounted(token_counts(parts), record_of(request.scope))
    rec = admit_tenant(state, request, parts)
    try:
        handle = state.client.open(parts, parts[0].params.n, **engine_share(rec))  # the engine shares capacity by tenant
    except Overloaded as e:
        raise APIError(overload_status or cfg.overload_status, f"the server is at capacity ({e}); retry later",
                       type="server_error", code="overloaded",
                       headers={"Retry-After": str(cfg.retry_after)}) from None
    except EngineDead as e:
        raise APIError(503, f"the engine is not running: {e}", type="server_error", code="engine_dead") from None
    gen = Generation(handle, state.text, stops, state.metrics, arrival, priors, special)
    if tracing.ACTIVE:
        request.scope[GENERATION_KEY] = gen  # the engine's spans are made from it (server/traces.py)
    if rec is not None:
        rec.sync = _usage_of(gen)
    try:
        it = gen.deltas()
        first = await until_disconnect(request, anext(it, None))
    except BaseException:
        handle.close()
        raise
    return Started(handle, gen, it, first)


def token_counts(parts: list[EnginePart]) -> TokenCounts:
    """What the request takes from its tenant's token limits (``admit_tenant``, and a router's count)."""
    n = parts[0].params.n
    return TokenCounts(input_tokens=sum(len(p.prompt_ids) for p in parts),
                       output_tokens=sum(p.params.max_tokens * n for p in parts),
                       context_tokens=max(len(p.prompt_ids) + p.params.max_tokens for p in parts))


class AdmissionCounted(APIError):
    """Not an error: the answer (200) to a router's count request (``COUNT_HEADER``), the request
    validated and tokenized as if it were to run, its counts instead of a generation. Raised from
    where they are known, past every check of the request, so they are exactly what this
    server's own admission would take; the request is no request of its tenant's (``probe``)."""

    def __init__(self, counts: TokenCounts, rec: RequestRecord | None) -> None:
        super().__init__(200, "token counts")
        self.counts = counts
        if rec is not None:
            rec.probe = True

    def body(self) -> dict[str, Any]:
        return dict(self.counts.as_json())

    def anthropic_body(self) -> dict[str, Any]:
        return self.body()


def admit_tenant(state: ServerState, request: Request, parts: list[EnginePart]) -> RequestRecord | None:
    """Take the request's place in its tenant's limits: 400 past ``max_context``, 429 (with
    ``Retry-After``, naming the limit) past a rate. Output tokens are reserved as ``max_tokens``
    times ``n`` per prompt; what is not generated is refunded when the answer ends."""
    return admit_counts(state, request, token_counts(parts), [p.prompt_ids for p in parts])


def admit_counts(state: ServerState, request: Request, counts: TokenCounts, prompts: list[list[int]],
                 param: str = "max_tokens") -> RequestRecord | None:
    """``admit_tenant`` for ``counts`` (the surfaces that do not generate, such as embeddings, whose
    input tokens count as prompt tokens); ``param``: what a ``max_context`` refusal names."""
    rec = record_of(request.scope)
    if rec is None:
        return None
    gate = state.tenants
    rec.model = state.model_name
    try:
        gate.check_context(rec, counts.context_tokens)
    except ValueError as e:
        raise APIError(400, str(e), param=param, code="context_length_exceeded") from None
    try:
        gate.admit(rec, input_tokens=counts.input_tokens, output_tokens=counts.output_tokens)
    except OverLimit as e:
        if e.never:
            raise APIError(400, str(e), param=param, code="tenant_limit_exceeded") from None
        raise APIError(429, str(e), type="rate_limit_error", code="rate_limit_exceeded",
                       headers={"Retry-After": e.retry_after_header}) from None
    if gate.audit is not None and gate.audit.content:
        rec.prompt = "\n".join(state.text.decode(p) for p in prompts)
    return rec


def engine_share(rec: RequestRecord | None) -> dict[str, str | float]:
    """Whose request the engine schedules, and that tenant's weight (``EngineClient.open``'s keywords)."""
    tenant = rec.identity.tenant if rec is not None else Tenant(DEFAULT_TENANT)
    return {"tenant": tenant.name, "weight": tenant.weight}


def _usage_of(gen: Generation) -> Callable[[RequestRecord], None]:
    """What the answer's end copies into its tenant record: tokens generated here (a
    continuation's resumed tokens were generated elsewhere), and the first token's time."""
    resumed = sum(len(p.token_ids) for p in gen.priors.values())

    def sync(rec: RequestRecord) -> None:
        rec.prompt_tokens = gen.usage.prompt_tokens
        rec.output_tokens = max(0, gen.usage.completion_tokens - resumed)
        rec.first_token = gen.first_token_time
        rec.token_times = True

    return sync
