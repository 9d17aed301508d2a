"""Tenant limits enforced by the router, across every replica behind it.

The router admits each API request against its tenant's limits in one step (``TenantAdmission``):
``requests_per_second`` and ``max_concurrent`` need no counts; the token limits
(``input_tokens_per_minute``, ``output_tokens_per_minute``) and ``max_context`` need the request's
token counts exactly as a server counts them: its prompt after the chat template, tools and all,
and its output reservation (``max_tokens`` × ``n``, the context's rest when a chat request names
none). The router does not tokenize; it asks a replica. It sends the request itself to one
routable replica with ``x-tripod-admission: count``; the replica validates, renders and tokenizes
it as for a generation and answers its ``TokenCounts`` instead of generating (the request is no
request of its tenant's there). The router then admits the counts into its tenant's windows — one
event loop, one set of windows for the whole fleet, so the limits are exact at their boundaries
for the fleet as they are for one server — and forwards the request. A replica's 4xx to the count
(a malformed request) is the client's answer as it is.

Output tokens are reserved at admission and the unused part refunded when the answer's count is
known (``OutputCount``): a whole answer's ``usage``; a stream's token ids under failover (what the
client was sent), or its ``usage`` (an Anthropic ``message_delta``; OpenAI's last chunk with
``stream_options.include_usage``). A stream whose count the router cannot see (an OpenAI stream
without failover or usage) keeps its whole reservation: the budget is never exceeded, at worst
under-used. An answer that failed before it began (an error status) is refunded whole.

The count costs one more request to a replica (a tokenization, no generation), made only for
tenants with a token limit or ``max_context``; other tenants are admitted without it. With two
routers in front of the same replicas each keeps its own windows (a tenant sending through both
may use each router's budget).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import httpx
from starlette.responses import Response

from tripod import tracing
from tripod.asgi import ClosingStream
from tripod.router.errors import RETRYABLE, RouterError
from tripod.router.failover import SSESplitter, parse_event
from tripod.tenants import (
    COUNT_HEADER,
    OverLimit,
    RequestRecord,
    TenantGate,
    TokenCounts,
    has_token_limits,
)

if TYPE_CHECKING:
    from tripod.router.router import Router

GENERATING = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses")


async def count_on_replica(router: Router, path: str, raw: bytes, body: dict[str, Any],
                           headers: dict[str, str]) -> TokenCounts | Response:
    """The request's token counts from a routable replica (waiting, bounded, for one, as a request
    does), or the replica's own 4xx answer to it; a 503 when no replica could count it."""
    assert router.client is not None
    rr = router.route_request(path, body)
    send = {k: v for k, v in headers.items() if k.lower() not in ("host", "content-length", "connection")}
    send[COUNT_HEADER] = "count"
    tried: set[Any] = set()
    last = "no replica answered"
    for _ in range(router.config.max_retries + 1):
        # The least busy routable replica: not the policy's choice (a count is no request to place,
        # and must not move a round robin); when none is routable, wait for one as a request does.
        cands = [r for r in router.routable() if r not in tried]
        rep = min(cands, key=lambda r: r.inflight) if cands else (await router.pick(rr, tried)).replica
        tried.add(rep)
        span = tracing.start_span("router.count_tokens", kind="client", attributes={
            "tripod.component": "router", "tripod.replica": rep.name}) if tracing.ACTIVE else None
        try:
            r = await router.client.post(rep.url + path, content=raw,
                                         headers=tracing.inject(send, span) if span is not None else send)
        except httpx.HTTPError as e:
            last = f"{rep.name}: {type(e).__name__}: {e}"
            router.record_failure(rep, f"{type(e).__name__}: {e}", fatal=isinstance(e, httpx.ConnectError))
            continue
        finally:
            if span is not None:
                tracing.end(span)
        if r.status_code == 200:
            try:
                return TokenCounts.from_json(r.json())
            except ValueError:
                raise RouterError(502, f"{rep.name} did not answer the router's token count (it must be a tripod "
                                  "server: the router counts tokens for the tenants' token limits there)",
                                  "replica_failed") from None
        if r.status_code in RETRYABLE:
            last = f"{rep.name} answered {r.status_code}"
            continue
        back = {k: v for k, v in r.headers.items() if k.lower() in ("content-type", "retry-after")}
        return Response(r.content, status_code=r.status_code, headers=back)
    raise RouterError(503, f"could not count the request's tokens for its tenant's limits ({last}); retry shortly",
                      "no_replica", router.config.retry_after)


class TenantAdmission:
    """One request's admission into its tenant's limits at the router (``Router.forward`` calls it
    once the request is in, before it queues)."""

    def __init__(self, gate: TenantGate, router: Router, rec: RequestRecord, path: str, raw: bytes,
                 body: dict[str, Any], headers: dict[str, str]) -> None:
        self.gate, self.router, self.rec = gate, router, rec
        self.path, self.raw, self.body, self.headers = path, raw, body, headers

    async def __call__(self) -> Response | None:
        """Admit the request (None), or the replica's 4xx to it; ``RouterError`` 400/429 past a limit."""
        rec, gate = self.rec, self.gate
        counts: TokenCounts | None = None
        if self.path in GENERATING and gate.enforce != "none" and has_token_limits(rec.identity.tenant):
            got = await count_on_replica(self.router, self.path, self.raw, self.body, self.headers)
            if isinstance(got, Response):
                return got
            counts = got
            try:
                gate.check_context(rec, counts.context_tokens)
            except ValueError as e:
                raise RouterError(400, str(e), "context_length_exceeded") from None
        try:
            gate.admit(rec, counts.input_tokens if counts else None, counts.output_tokens if counts else None)
        except OverLimit as e:
            if e.never:
                raise RouterError(400, str(e), "tenant_limit_exceeded") from None
            raise RouterError(429, str(e), "rate_limit_exceeded", int(e.retry_after_header)) from None
        if counts is not None and counts.output_tokens:
            rec.output_known = False  # until the answer's own count comes (OutputCount)
        return None


class OutputCount:
    """A stream's output tokens as the router sees them pass, into its tenant record when it closes."""

    def __init__(self, rec: RequestRecord, resp: ClosingStream) -> None:
        self.rec = rec
        self.split = SSESplitter()
        self.usage: int | None = None
        self.answer = getattr(resp, "answer", None)  # under failover: the AnswerProgress (router/proxy.py)
        inner = resp.body_iterator
        resp.body_iterator = self._watch(inner)
        on_close = resp.on_close

        def closed() -> None:
            try:
                on_close()
            finally:
                self._settle()

        resp.on_close = closed

    async def _watch(self, inner: AsyncIterator[Any]) -> AsyncIterator[Any]:
        async for chunk in inner:
            if self.answer is None and isinstance(chunk, bytes):
                self._read(chunk)
            yield chunk

    def _read(self, chunk: bytes) -> None:
        for event in self.split.feed(chunk):
            _, data = parse_event(event)
            if '"usage"' not in data:
                continue
            try:
                usage = json.loads(data).get("usage") or {}
            except (ValueError, AttributeError):
                continue
            n = usage.get("completion_tokens", usage.get("output_tokens")) if isinstance(usage, dict) else None
            if isinstance(n, int) and not isinstance(n, bool):
                self.usage = n  # (Anthropic's is cumulative: the last one counts)

    def _settle(self) -> None:
        if self.answer is not None:
            self.rec.output_tokens = sum(len(c.token_ids) for c in self.answer.choices.values())
            self.rec.output_known = True
        elif self.usage is not None:
            self.rec.output_tokens = self.usage
            self.rec.output_known = True


def settle_whole(rec: RequestRecord | None, resp: Response) -> None:
    """A whole answer's output count (``count_usage`` read its usage): an error status generated
    nothing for the client, its reservation is refunded; a stream is ``OutputCount``'s."""
    if rec is None or rec.output_known or isinstance(resp, ClosingStream):
        return
    if resp.status_code != 200:
        rec.output_tokens = 0
        rec.output_known = True
