"""Prefill/decode disaggregation on a server (``tripod serve --role prefill|decode``).

```
router ──POST /v1/pd/prefill {path, body, decode_url}──▶ prefill replica
            render the prompt as the API route would ─▶ engine: the prompt, 1 token (its KV is cached)
            ExportKV ─▶ the prompt's whole blocks, as disk-tier block files (memory/kv_transfer.py)
            ──POST /v1/pd/kv (the blocks, streamed)──▶ decode replica
                        BlockReceiver: verify each block (identity, hash chain, CRC) ─▶ publish into
                        its disk tier's directory  ◀── its engine loads them on admission
router ◀── PrefillDone (tokens, blocks, bytes, seconds)
router ──the client's request (+ the hand-over's id)──▶ decode replica: HandOverGate lets that id's KV
            streams end first, then the prompt's blocks hit as a prefix
```

The decode replica answers the request exactly as any replica would (prefix caching, structured
outputs, speculative decoding, failover continuation are its own), so an answer is the same with
or without the hand-over; only where the prompt's KV was computed differs. A transfer cut part-way
leaves whole verified blocks of a prefix, never a wrong one; the router then retries the prefill
elsewhere or lets the decode replica prefill the rest itself.

Test hook (tests only): ``TRIPOD_TEST_PD_KILL_AFTER_BLOCKS=N:MARKER`` makes a prefill replica
SIGKILL itself after sending N blocks of a transfer, once (it creates MARKER first; when MARKER
exists it does nothing), so a test can kill a prefill replica mid-transfer deterministically.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import msgspec
import torch
from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import Counter, Histogram
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send

from tripod.asgi import header
from tripod.memory.kv_blocks import TierLayout
from tripod.memory.kv_transfer import CONTENT_TYPE, BlockReceiver, TransferRefused
from tripod.protocol import pd
from tripod.protocol.sampling import SamplingParams
from tripod.server.api.body import parse, read_body
from tripod.server.api.openai import prompt_ids
from tripod.server.api.openai_requests import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_messages,
    openai_tools,
)
from tripod.server.engine_client import EngineDead, EnginePart, Overloaded
from tripod.server.errors import APIError
from tripod.server.media.prompt import Prompt, render_prompt
from tripod.server.state import ServerState, adapter_of, check_model

log = logging.getLogger("tripod.server.pd")

KILL_HOOK = "TRIPOD_TEST_PD_KILL_AFTER_BLOCKS"
# How long a request waits for its hand-over's KV streams to end: a stream from a prefill replica
# that died without closing its connection (a host gone) is not waited for past this.
SETTLE_SECONDS = 5.0
_SECONDS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class PDMetrics:
    """The server's prefill/decode hand-over series (both sides; a replica shows the side it plays)."""

    def __init__(self, state: ServerState) -> None:
        r, m = state.metrics.registry, ["model_name"]
        self.state = state
        self.prefills = Counter("tripod:pd_prefills", "prefill hand-overs by outcome (ok, failed, refused)",
                                [*m, "outcome"], registry=r)
        self.sent_blocks = Counter("tripod:pd_kv_sent_blocks", "KV blocks sent to decode replicas", m, registry=r)
        self.sent_bytes = Counter("tripod:pd_kv_sent_bytes", "KV bytes sent to decode replicas", m, registry=r)
        self.prefill_seconds = Histogram("tripod:pd_prefill_seconds", "computing a handed-over prompt's KV", m,
                                         buckets=_SECONDS, registry=r)
        self.send_seconds = Histogram("tripod:pd_kv_send_seconds", "exporting and sending a prompt's KV", m,
                                      buckets=_SECONDS, registry=r)
        self.receives = Counter("tripod:pd_kv_receives", "KV streams received by outcome (ok, cut, refused)",
                                [*m, "outcome"], registry=r)
        self.received_blocks = Counter("tripod:pd_kv_received_blocks", "KV blocks received and verified", m,
                                       registry=r)
        self.received_bytes = Counter("tripod:pd_kv_received_bytes", "KV bytes received and verified", m, registry=r)
        self.receive_seconds = Histogram("tripod:pd_kv_receive_seconds", "receiving one KV stream", m,
                                         buckets=_SECONDS, registry=r)

    @property
    def model(self) -> str:
        return self.state.metrics.model_name


class Receiving:
    """The KV streams a decode replica is receiving, by the router's hand-over id."""

    def __init__(self) -> None:
        self._open: dict[str, list[asyncio.Event]] = {}

    @contextmanager
    def stream(self, transfer_id: str) -> Iterator[None]:
        done = asyncio.Event()
        self._open.setdefault(transfer_id, []).append(done)
        try:
            yield
        finally:
            done.set()
            events = self._open.get(transfer_id, [])
            if done in events:
                events.remove(done)
            if not events:
                self._open.pop(transfer_id, None)

    async def settled(self, transfer_id: str, timeout: float = SETTLE_SECONDS) -> bool:
        """Wait until no stream of ``transfer_id`` is open (False: some still were after ``timeout``)."""
        events = list(self._open.get(transfer_id, ()))
        if not events:
            return True
        try:
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), timeout)
        except TimeoutError:
            log.warning("hand-over %s: a KV stream was still open after %.0f s; answering with the blocks it "
                        "published so far", transfer_id, timeout)
            return False
        return True


class HandOverGate:
    """Pure ASGI, inside the key check: a KV stream carrying a hand-over id is registered in
    ``receiving`` for as long as it is received; a request carrying one (the router's request after
    the hand-over, e.g. its fallback after a prefill replica died mid-transfer) waits until that
    id's streams have ended, so its admission finds every block they verified."""

    def __init__(self, app: ASGIApp, receiving: Receiving) -> None:
        self.app = app
        self.receiving = receiving
        self._header = pd.TRANSFER_HEADER.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        tid = header(scope, self._header) if scope["type"] == "http" else None
        tid = tid[:64] if tid is not None else None
        if tid is None:
            await self.app(scope, receive, send)
        elif scope["path"] == pd.KV_PATH:
            with self.receiving.stream(tid):
                await self.app(scope, receive, send)
        else:
            if scope["path"] in pd.PD_PATHS:
                await self.receiving.settled(tid)
            await self.app(scope, receive, send)


def add_pd_routes(app: FastAPI, state: ServerState) -> None:
    metrics = PDMetrics(state)

    @app.post(pd.PREFILL_PATH, include_in_schema=False)
    async def prefill(request: Request) -> Response:
        raw = await read_body(request, state.config.max_body_bytes)
        try:
            order = pd.decode_order(raw)
        except (msgspec.ValidationError, msgspec.DecodeError) as e:
            raise APIError(400, f"not a prefill order: {e}") from None
        try:
            done = await _prefill(state, metrics, order, request.headers.get("authorization"))
        except APIError as e:
            metrics.prefills.labels(metrics.model, "refused" if e.status < 500 else "failed").inc()
            raise
        except Exception:
            metrics.prefills.labels(metrics.model, "failed").inc()
            raise
        metrics.prefills.labels(metrics.model, "ok").inc()
        return Response(pd.encode(done), media_type="application/json")

    @app.post(pd.KV_PATH, include_in_schema=False)
    async def receive_kv(request: Request) -> Response:
        card = state.client.info.kv_tier if state.client.info is not None else None
        if card is None:
            raise APIError(409, "this replica has no disk tier to receive KV into: run it with --role decode (or "
                           "--kv-disk DIR)", code="kv_transfer_refused")
        layout = TierLayout(bytes.fromhex(card.identity), card.num_layers, tuple(card.row_shape),
                            getattr(torch, card.dtype), card.block_tokens, card.state_bytes)
        receiver = BlockReceiver(layout, Path(card.dir))
        t0 = time.perf_counter()
        try:
            async for chunk in request.stream():
                if chunk:
                    await asyncio.to_thread(receiver.feed, chunk)  # file writes off the event loop
        except TransferRefused as e:
            metrics.receives.labels(metrics.model, "refused").inc()
            log.error("refused a KV transfer: %s", e)
            raise APIError(e.status, str(e), code="kv_transfer_refused") from None
        except ClientDisconnect:
            outcome = "cut"  # the sender died: whatever whole blocks came are published, the rest never
        else:
            outcome = "cut" if receiver.leftover else "ok"
        finally:
            c = receiver.counts
            metrics.received_blocks.labels(metrics.model).inc(c.blocks)
            metrics.received_bytes.labels(metrics.model).inc(c.bytes)
            metrics.receive_seconds.labels(metrics.model).observe(time.perf_counter() - t0)
        metrics.receives.labels(metrics.model, outcome).inc()
        if outcome == "cut":
            log.warning("a KV transfer was cut after %d whole blocks", receiver.counts.blocks)
            return Response(status_code=499)
        c = receiver.counts
        return Response(pd.encode(pd.KVReceipt(blocks=c.blocks, published=c.published, bytes=c.bytes)),
                        media_type="application/json")


async def _prompts(state: ServerState, order: pd.PrefillOrder) -> list[Prompt]:
    """The prompts the API route will make of ``order.body`` (the same code, so the same ids and
    images: a vision-language model's prompt is loaded and expanded here as it will be there)."""
    req: ChatCompletionRequest | CompletionRequest = parse(
        ChatCompletionRequest if order.path == "/v1/chat/completions" else CompletionRequest, bytes(order.body))
    check_model(state, req.model)
    if adapter_of(state, req.model) is not None:
        # NOTE: a LoRA adapter's prefixes are keyed in its own cache namespace and never loaded from
        # the disk tier, so blocks handed over would not be used: the decode replica prefills them.
        raise APIError(422, f"the model {req.model!r} is a LoRA adapter: its prompts are prefilled where they are "
                       "answered", code="pd_not_applicable")
    if isinstance(req, ChatCompletionRequest):
        tools, _choice = openai_tools(req, state.chat.parallel_default)
        return [await render_prompt(state, chat_messages(req.messages), tools)]
    return [Prompt(ids) for ids in prompt_ids(state, req.prompt)]


async def _prefill(state: ServerState, metrics: PDMetrics, order: pd.PrefillOrder,
                   authorization: str | None) -> pd.PrefillDone:
    if state.draining:
        raise APIError(503, "the server is shutting down", type="server_error", code="draining")
    prompts = await _prompts(state, order)
    for p in prompts:
        if len(p.ids) >= state.max_len:
            raise APIError(400, f"the prompt ({len(p.ids)} tokens{p.note}) does not fit this server's context "
                           f"({state.max_len})", param="messages")
    t0 = time.perf_counter()
    for p in prompts:
        await _compute(state, p)
    t1 = time.perf_counter()
    blocks: list[bytes] = []
    for p in prompts:
        try:
            export = await state.client.export_kv(p.ids, p.images)
        except EngineDead as e:
            raise APIError(503, f"the engine is not running: {e}", type="server_error", code="engine_dead") from None
        if export.error is not None:
            raise APIError(409, export.error, code="kv_transfer_refused")
        blocks += export.blocks
    t2 = time.perf_counter()
    receipt = await _send(order, blocks, authorization)
    t3 = time.perf_counter()
    m = metrics.model
    metrics.sent_blocks.labels(m).inc(len(blocks))
    metrics.sent_bytes.labels(m).inc(sum(len(b) for b in blocks))
    metrics.prefill_seconds.labels(m).observe(t1 - t0)
    metrics.send_seconds.labels(m).observe(t3 - t1)
    return pd.PrefillDone(prompt_tokens=sum(len(p.ids) for p in prompts), blocks=len(blocks), accepted=receipt.blocks,
                          published=receipt.published, bytes=sum(len(b) for b in blocks), prefill_seconds=t1 - t0,
                          export_seconds=t2 - t1, transfer_seconds=t3 - t2)


async def _compute(state: ServerState, prompt: Prompt) -> None:
    """Run ``prompt`` through the engine for one greedy token: its KV is then in the prefix cache. A
    hybrid model's: all but its last token, so that the state snapshot taken at the end is the one a
    decode replica resumes from (its admission computes the prompt's last token itself)."""
    ids = prompt.ids
    if state.client.info is not None and state.client.info.state_bytes and len(ids) > 1:
        ids = ids[:-1]
    part = EnginePart(f"pd-{uuid.uuid4().hex[:16]}", ids, SamplingParams(max_tokens=1, temperature=0.0),
                      images=prompt.images)
    try:
        handle = state.client.open([part], 1)
    except Overloaded as e:
        raise APIError(429, f"the prefill replica is at capacity ({e}); retry later", type="server_error",
                       code="overloaded", headers={"Retry-After": str(state.config.retry_after)}) from None
    except EngineDead as e:
        raise APIError(503, f"the engine is not running: {e}", type="server_error", code="engine_dead") from None
    try:
        async for out in handle:
            if out.finish_reason == "rejected":
                raise APIError(400, out.error or "the engine refused the prompt")
    except EngineDead as e:
        raise APIError(503, f"the engine is not running: {e}", type="server_error", code="engine_dead") from None
    finally:
        handle.close()


async def _send(order: pd.PrefillOrder, blocks: list[bytes], authorization: str | None) -> pd.KVReceipt:
    """Stream ``blocks`` to the order's decode replica; its receipt (an APIError when it refuses)."""
    url = order.decode_url
    headers = {"content-type": CONTENT_TYPE}
    if order.transfer_id:
        headers[pd.TRANSFER_HEADER] = order.transfer_id
    if authorization:
        headers["authorization"] = authorization
    kill_after = _kill_hook(len(blocks))

    async def body() -> AsyncIterator[bytes]:
        for i, block in enumerate(blocks):
            if kill_after is not None and i == kill_after:
                log.warning("%s: killing this replica after %d blocks of a transfer (test hook)", KILL_HOOK, i)
                os.kill(os.getpid(), signal.SIGKILL)
            yield block

    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0, connect=5.0)) as client:
        try:
            r = await client.post(url.rstrip("/") + pd.KV_PATH, content=body(), headers=headers)
        except httpx.HTTPError as e:
            raise APIError(502, f"sending the KV to {url} failed: {type(e).__name__}: {e}", type="server_error",
                           code="kv_transfer_failed") from None
    if r.status_code != 200:
        raise APIError(409 if r.status_code == 409 else 502, f"the decode replica at {url} answered "
                       f"{r.status_code}: {r.text[:300]}", type="server_error",
                       code="kv_transfer_refused" if r.status_code == 409 else "kv_transfer_failed")
    try:
        return pd.decode_receipt(r.content)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise APIError(502, f"the decode replica at {url} sent no KV receipt: {e}", type="server_error") from None


def _kill_hook(blocks: int) -> int | None:
    """The test hook (module docstring): the block index to die at, once, or None."""
    spec = os.environ.get(KILL_HOOK)
    if not spec:
        return None
    count, _, marker = spec.partition(":")
    if int(count) >= blocks:
        return None  # not mid-transfer: wait for a longer one
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except OSError:
        return None  # fired already (or no marker path): never again
    os.close(fd)
    return int(count)
