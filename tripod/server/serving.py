"""What every API surface of the HTTP process shares: the server's state, request-body and
disconnect helpers, and starting a generation (admission, the first delta, client gone).

The API modules (``openai_api``, ``anthropic_api``, ``admin_api``) build their answers on these;
``app.build_app`` wires them together.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from tripod import asgi, tracing
from tripod.asgi import ClientGone as ClientGone  # (the app answers it with 499)
from tripod.asgi import until_disconnect as until_disconnect
from tripod.config import EngineConfig, ServerConfig
from tripod.server.answer.conversation import ChatRenderer
from tripod.server.answer.generation import Delta, Generation, Prior
from tripod.server.answer.reasoning import ReasoningParser, Thinking, choose_parser
from tripod.server.answer.text import TextSide
from tripod.server.engine_client import (
    EngineClient,
    EngineDead,
    EnginePart,
    Overloaded,
    RequestHandle,
)
from tripod.server.errors import APIError, too_large
from tripod.server.metrics import ServerMetrics
from tripod.server.sampling import Limits
from tripod.tenants import (
    COUNT_HEADER,
    DEFAULT_TENANT,
    AuditLog,
    OverLimit,
    RequestRecord,
    Tenant,
    TenantGate,
    TenantRegistry,
    TokenCounts,
    record_of,
)

GENERATION_KEY = "tripod.generation"  # (tracing on) the request's Generation, in its ASGI scope


@dataclass
class ServerState:
    """Everything the routes share. ``exit_code`` is what the process exits with."""

    engine_config: EngineConfig
    config: ServerConfig
    text: TextSide
    client: EngineClient
    model_name: str
    quantization: str
    metrics: ServerMetrics
    created: int = field(default_factory=lambda: int(time.time()))
    draining: bool = False
    exit_code: int = 0
    request_shutdown: Callable[[], None] | None = None
    renderer: ChatRenderer | None = None
    gate: TenantGate | None = None  # None: made from config (launch.serve makes it first, to refuse a bad file)
    architecture: str | None = None  # the model's (for --reasoning-parser auto)
    reasoning: ReasoningParser | None = field(init=False, default=None)  # None: answers are not split

    def __post_init__(self) -> None:
        if self.renderer is None:
            self.renderer = ChatRenderer(self.text)
        self.reasoning = choose_parser(self.config.reasoning_parser, self.text.template, self.architecture)
        if self.gate is None:
            self.gate = make_gate(self.config, self.metrics)

    def thinking(self, prompt_ids: list[int], budget: int | None = None, param: str = "thinking_budget",
                 ) -> Thinking | None:
        """The reasoning of a request with this prompt (None: the model has no reasoning parser).
        ``budget`` (tokens of thinking at most) is checked here: it needs a parser."""
        if self.reasoning is None:
            if budget is not None:
                raise APIError(400, f"'{param}' needs a model that thinks; this server has no reasoning parser "
                               "(see --reasoning-parser)", param=param)
            return None
        if budget is not None and budget < 1:
            raise APIError(400, f"'{param}' must be >= 1 (got {budget})", param=param)
        # NOTE: the prompt's end says whether the template opened (or closed) the thinking block.
        tail = self.text.decode(prompt_ids[-16:], skip_special_tokens=False)
        return Thinking(self.reasoning, self.reasoning.start(tail))

    @property
    def tenants(self) -> TenantGate:
        assert self.gate is not None
        return self.gate

    @property
    def chat(self) -> ChatRenderer:
        assert self.renderer is not None
        return self.renderer

    @property
    def max_len(self) -> int:
        info = self.client.info
        assert info is not None
        return info.max_request_len

    @property
    def limits(self) -> Limits:
        return Limits(self.max_len, self.config.max_n, self.text.vocab_size)

    def fingerprint(self) -> str:
        info = self.client.info
        return f"tripod-{info.dtype if info else '?'}-{self.quantization}"


def make_gate(config: ServerConfig, metrics: ServerMetrics) -> TenantGate:
    """The server's tenants: the file (a ``TenantFileError`` when it is invalid), the plain key, the
    audit log (an ``OSError`` when it cannot be opened)."""
    registry = TenantRegistry(config.tenants, config.api_key)
    audit = (AuditLog(config.audit_log, content=config.audit_log_content, max_bytes=config.audit_log_max_bytes)
             if config.audit_log else None)
    return TenantGate(registry, metrics.tenants, audit, enforce=config.tenant_limits)


async def read_body(request: Request, limit: int) -> bytes:
    try:
        return await asgi.read_body(request, limit)
    except asgi.BodyTooLarge:
        raise too_large(limit) from None


def adapter_of(state: ServerState, name: str | None) -> str | None:
    """The LoRA adapter a request's ``model`` names (None: the base model)."""
    loras = state.client.loras
    return name if name is not None and loras and name in loras and name not in (state.model_name, "default") else None


def check_model(state: ServerState, name: str | None, request: Request | None = None) -> None:
    """404 for a model this server does not serve (the base model or one of its LoRA adapters),
    or (``request``'s tenant has a ``models`` list) one its tenant may not use."""
    adapter = adapter_of(state, name)
    if name is not None and adapter is None and name not in (state.model_name, "default"):
        also = f" and the LoRA adapters {', '.join(sorted(state.client.loras))}" if state.client.loras else ""
        raise APIError(404, f"the model {name!r} does not exist; this server serves {state.model_name!r}{also}",
                       param="model", code="model_not_found")
    if request is not None:
        try:
            state.tenants.check_model(record_of(request.scope), adapter or state.model_name)
        except PermissionError as e:
            raise APIError(404, f"{e}; see the tenant's 'models' in the tenants file", param="model",
                           code="model_not_found") from None


def check_ids(state: ServerState, ids: list[int], what: str) -> None:
    try:
        state.text.check_ids(ids, what)
    except ValueError as e:
        raise APIError(400, str(e), param=what) from None


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
        request.scope[GENERATION_KEY] = gen  # the engine's spans are made from it (server/app.py)
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
    rec = record_of(request.scope)
    if rec is None:
        return None
    gate = state.tenants
    counts = token_counts(parts)
    rec.model = state.model_name
    try:
        gate.check_context(rec, counts.context_tokens)
    except ValueError as e:
        raise APIError(400, str(e), param="max_tokens", code="context_length_exceeded") from None
    try:
        gate.admit(rec, input_tokens=counts.input_tokens, output_tokens=counts.output_tokens)
    except OverLimit as e:
        if e.never:
            raise APIError(400, str(e), param="max_tokens", code="tenant_limit_exceeded") from None
        raise APIError(429, str(e), type="rate_limit_error", code="rate_limit_exceeded",
                       headers={"Retry-After": e.retry_after_header}) from None
    if gate.audit is not None and gate.audit.content:
        rec.prompt = "\n".join(state.text.decode(p.prompt_ids) for p in parts)
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
