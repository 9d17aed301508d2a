"""The server's spans (``tripod.tracing``): ``server.request`` per API request, and under it the
engine's ``engine.queue`` / ``engine.prefill`` / ``engine.decode`` per sequence, made when the
request ends from the times the engine process reported (``engine_ipc.SeqTiming``)."""

from __future__ import annotations

import time
from typing import Any

from starlette.types import Scope

from tripod import tracing
from tripod.protocol.engine_ipc import SeqTiming
from tripod.server.answer.generation import Generation

GENERATION_KEY = "tripod.generation"  # (tracing on) the request's Generation, in its ASGI scope


def finish_request(scope: Scope, span: Any) -> None:
    """What the app learned about the request, onto its span: its tenant and, for a generation,
    the engine's spans."""
    tenant = tracing.tenant_of(scope)
    if tenant is not None:
        span.set_attribute("tripod.tenant", tenant)
    gen = scope.get(GENERATION_KEY)
    if isinstance(gen, Generation):
        engine_spans(span, gen)


def engine_spans(parent: Any, gen: Generation) -> None:
    u = gen.usage
    parent.set_attribute("tripod.continuation", bool(gen.priors))
    parent.set_attribute("gen_ai.usage.input_tokens", u.prompt_tokens)
    parent.set_attribute("gen_ai.usage.output_tokens", u.completion_tokens)
    parent.set_attribute("tripod.cached_tokens", u.cached_tokens)
    for (rid, index), t in gen.timings.items():
        seq = gen.seqs.get((rid, index))
        attrs = {"tripod.component": "engine", "tripod.engine_rid": rid,
                 "tripod.choice": seq.index if seq is not None else index}
        _spans(parent, t, attrs, seq.tokens if seq is not None else 0)


def _spans(parent: Any, t: SeqTiming, attrs: dict[str, Any], tokens: int) -> None:
    offset = tracing.monotonic_to_ns(0.0)  # NOTE: once, so that one span ends exactly where the next begins

    def ns(m: float) -> int:
        return offset + int(m * 1e9)

    end = t.finished if t.finished is not None else time.monotonic()  # (aborted: the client left)
    first = t.first_token if t.first_token is not None else end
    for name, a, b, extra in (
        ("engine.queue", t.arrival, t.scheduled, {}),
        ("engine.prefill", t.scheduled, first, {}),
        ("engine.decode", first, end, {"tripod.output_tokens": tokens}),
    ):
        if name == "engine.decode" and t.first_token is None:
            continue  # never got to decode
        span = tracing.start_span(name, parent=parent, start_ns=ns(a), attributes={**attrs, **extra})
        tracing.end(span, end_ns=ns(max(a, b)))
