"""What the HTTP app holds: ``ServerState`` (the configs, the tokenizer side, the engine link, the
metrics, the tenants) and the checks every surface makes against it (the model a request names,
token ids in the vocabulary).

The API surfaces (``tripod.server.api``) read it; ``app.build_app`` is built on it and
``launch.serve`` makes it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from fastapi import Request

from tripod.config import EngineConfig, ServerConfig
from tripod.server.answer.conversation import ChatRenderer
from tripod.server.answer.reasoning import ReasoningParser, Thinking, choose_parser
from tripod.server.answer.text import TextSide
from tripod.server.engine_client import EngineClient
from tripod.server.errors import APIError
from tripod.server.media.vision import VisionSide, images_served
from tripod.server.metrics import ServerMetrics
from tripod.server.response_store import ResponseStore, open_store
from tripod.tenants import AuditLog, TenantGate, TenantRegistry, record_of

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Limits:
    """What the served model and the server's configuration allow."""

    max_len: int  # prompt + output tokens
    max_n: int
    vocab_size: int


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
    # Whether requests may hold images: the checkpoint's processor is here and the engine reads
    # them (Ready.modalities); set by engine_ready().
    takes_images: bool = field(init=False, default=False)
    store: ResponseStore | None = None  # /v1/responses' (None: made from config; launch.serve opens it first)
    # The model's image side (its processor, the image loader); None: the checkpoint is text-only.
    vision: VisionSide | None = None

    def __post_init__(self) -> None:
        if self.renderer is None:
            # A vision-language model's template takes content as a list of parts (answer/conversation.py).
            self.renderer = ChatRenderer(self.text, parts=self.vision is not None)
        self.reasoning = choose_parser(self.config.reasoning_parser, self.text.template, self.architecture)
        if self.gate is None:
            self.gate = make_gate(self.config, self.metrics)
        if self.store is None:
            self.store = make_store(self.config)

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
    def responses(self) -> ResponseStore:
        assert self.store is not None
        return self.store

    @property
    def chat(self) -> ChatRenderer:
        assert self.renderer is not None
        return self.renderer

    def engine_ready(self) -> None:
        """Called once the engine is ready (``Ready``): whether images are served is settled."""
        info = self.client.info
        assert info is not None
        self.takes_images = images_served(self.vision, info.modalities, self.model_name)

    @property
    def modalities(self) -> list[str]:
        """What the served model reads (``/v1/models``)."""
        return ["text", "image"] if self.takes_images else ["text"]

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


def make_store(config: ServerConfig) -> ResponseStore:
    """The Responses API's store as ``--responses-store`` says (a ``StoreError`` when it cannot be opened)."""
    store = open_store(config.responses_store, max_count=config.responses_max_count,
                       max_bytes=config.responses_max_bytes, ttl=config.responses_ttl)
    failed = store.fail_orphans()  # background runs of a server that died (never a live replica's)
    if failed:
        log.warning("%d background response(s) left in progress by a server that is gone marked failed: %s",
                    len(failed), ", ".join(failed[:5]) + (" ..." if len(failed) > 5 else ""))
    return store


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
    """400 (naming ``what``) for token ids outside the vocabulary."""
    try:
        state.text.check_ids(ids, what)
    except ValueError as e:
        raise APIError(400, str(e), param=what) from None


