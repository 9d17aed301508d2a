"""One HTTP generation request in flight: engine outputs → text deltas → OpenAI responses.

``Generation`` turns the ``SeqOutput`` stream of a ``RequestHandle`` into ``Delta``s (text that
may be shown, with stop strings applied), keeps usage and latency numbers, and ends sequences
early in the engine when a stop string matches. The same deltas feed the streaming (SSE) and the
non-streaming answers, so both give the same text.

A continuation (the router's failover: ``Prior`` per choice) primes each choice's text with the
tokens it had generated elsewhere, so stop strings and multi-byte characters spanning the cut
come out as they would have; a continued stream then starts exactly after the characters the
client has (``Prior.chars``), a continued whole answer includes everything.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from tripod.protocol import engine_ipc
from tripod.protocol.engine_ipc import Logprob
from tripod.protocol.failover import Progress, encode_progress
from tripod.server.answer.text import SeqText, TextSide
from tripod.server.engine_client import EngineDead, RequestHandle
from tripod.server.errors import APIError
from tripod.server.metrics import ServerMetrics


@dataclass(slots=True)
class Delta:
    index: int  # the choice index
    text: str
    token_ids: list[int]
    logprobs: list[Logprob]  # per token (empty unless asked for)
    finish_reason: str | None = None
    stop_sequence: str | None = None  # the stop string that ended the sequence, if one did
    prompt_logprobs: list[Logprob] | None = None  # params.prompt_logprobs, with the first delta
    # A continued stream: text before ``text`` that the client has already (for stateful parsers
    # of the text, e.g. tool calls, to be fed without emitting anything).
    replayed: str = ""
    chars: int = 0  # characters of the choice's text delivered through this delta (its resume point)


@dataclass(slots=True)
class Prior:
    """What one choice of a continued request had produced before, on another replica."""

    token_ids: list[int]
    chars: int | None = None  # a stream: characters of its text the client has; None: a whole answer
    logprobs: list[Logprob] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass(slots=True)
class _Seq:
    index: int
    text: SeqText
    tokens: int = 0
    last_time: float = 0.0
    finish_reason: str | None = None
    chars: int = 0  # characters of its text delivered so far
    # A continued stream: text to send before the next text (the client lacks it) ...
    prefix: str = ""
    # ... or characters of the coming text the client has already, and text it has that a
    # stateful parser has not been fed yet.
    skip: int = 0
    replay: str = ""
    # Tokens of outputs that made no delta (nothing to show yet: a special token, half a
    # character, a held-back stop string): they go with the next delta, so that the token ids
    # deltas carry are always every token, in order (what a continuation resumes from).
    unsent: list[int] = field(default_factory=list)


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0  # image tokens included
    completion_tokens: int = 0
    cached_tokens: int = 0
    image_tokens: int = 0  # of prompt_tokens, those that are images'

    def body(self) -> dict[str, Any]:
        details: dict[str, int] = {"cached_tokens": self.cached_tokens}
        if self.image_tokens:  # (OpenAI's fields for a prompt's share of images and of text)
            details["image_tokens"] = self.image_tokens
            details["text_tokens"] = self.prompt_tokens - self.image_tokens
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": details,
        }


class Generation:
    """Owns one HTTP request's sequences: their text, stop strings, usage and latency metrics."""

    def __init__(
        self,
        handle: RequestHandle,
        text: TextSide,
        stops: list[str],
        metrics: ServerMetrics,
        arrival: float,
        priors: dict[int, Prior] | None = None,
        special: bool = False,
    ) -> None:
        self.handle = handle
        self.metrics = metrics
        self.arrival = arrival
        n = handle.n
        self.seqs = {
            (p.rid, i): _Seq(pi * n + i, SeqText(text, stops, special))
            for pi, p in enumerate(handle.parts)
            for i in p.copies
        }
        self.usage = Usage(prompt_tokens=sum(len(p.prompt_ids) for p in handle.parts),
                           image_tokens=sum(p.image_tokens for p in handle.parts))
        self._cached_seen: set[str] = set()
        self.first_token_time: float | None = None
        # Tracing: each sequence's times in the engine (reported only when tracing is on).
        self.timings: dict[tuple[str, int], engine_ipc.SeqTiming] = {}
        # A continuation: per choice index, what it had produced, and (whole answers) its text so far.
        self.priors = priors or {}
        # The weights the engine ran it on (every output of a request carries the same version).
        self.weight_version: int | None = None
        self.routed_experts: dict[int, list[list[list[int]]]] = {}  # choice -> routing (return_routed_experts)
        self.prior_text: dict[int, str] = {}
        by_index = {s.index: s for s in self.seqs.values()}
        for idx, prior in self.priors.items():
            self.usage.completion_tokens += len(prior.token_ids)
            seq = by_index.get(idx)
            if seq is None:  # a choice that had finished: its text, for a whole answer
                assert prior.finish_reason is not None, idx
                self.prior_text[idx] = SeqText(text, stops, special).push(prior.token_ids, final=True)
                continue
            # NOTE: the text side is primed with the choice's tokens, so text held back at the cut
            # (the start of a stop string, part of a multi-byte character) is decided exactly as
            # it would have been; what the client has is then skipped, what it lacks sent.
            primed = seq.text.push(prior.token_ids)
            if prior.chars is None:
                self.prior_text[idx] = primed
                continue
            seq.chars = prior.chars
            seq.replay = primed[: prior.chars]
            seq.prefix = primed[prior.chars :]
            seq.skip = max(0, prior.chars - len(primed))

    async def deltas(self) -> AsyncIterator[Delta]:
        try:
            async for out in self.handle:
                d = self._apply(out)
                if d is not None:
                    yield d
        except EngineDead as e:
            raise APIError(503, f"the engine stopped while serving this request: {e}",
                           type="server_error", code="engine_dead") from None

    def _apply(self, out: engine_ipc.SeqOutput) -> Delta | None:
        seq = self.seqs[(out.rid, out.index)]
        self.weight_version = out.weight_version
        if out.routed_experts is not None:
            self.routed_experts[seq.index] = out.routed_experts
        if out.timing is not None:
            self.timings[(out.rid, out.index)] = out.timing
        if out.finish_reason == "rejected":
            raise APIError(400, out.error or "the engine refused the request")
        if out.finish_reason == "error":
            raise APIError(500, f"the engine could not serve this request: {out.error}",
                           type="server_error", code="engine_error")
        if out.rid not in self._cached_seen and out.token_ids:
            self._count_prompt(out)
        final = out.finish_reason is not None
        text, ids, lps = self._push_text(seq, out, final)
        replayed = seq.replay
        if seq.prefix:
            text, seq.prefix = seq.prefix + text, ""
        if seq.skip:
            cut = min(seq.skip, len(text))
            replayed += text[:cut]
            text, seq.skip = text[cut:], seq.skip - cut
        seq.replay = ""
        seq.chars += len(text)
        if ids:
            self._count_tokens(seq, len(ids))
        finish = None
        if seq.text.stopped:
            finish = "stop"
            if not final:
                self.handle.stop_seq(out.rid, out.index)
        elif final:
            finish = out.finish_reason
        if finish is not None:
            seq.finish_reason = finish
            self.metrics.request_success.labels(self.metrics.model_name, finish).inc()
        ids, seq.unsent = seq.unsent + ids, []
        if not text and not lps and finish is None and out.prompt_logprobs is None:
            seq.replay = replayed  # fed to a parser with the next delta
            seq.unsent = ids
            return None
        return Delta(seq.index, text, ids, lps, finish,
                     seq.text.matched if finish == "stop" else None, out.prompt_logprobs, replayed, seq.chars)

    @staticmethod
    def _push_text(seq: _Seq, out: engine_ipc.SeqOutput, final: bool) -> tuple[str, list[int], list[Logprob]]:
        """The text ``out``'s tokens make, and the tokens (with their logprobs) that count."""
        ids, lps = out.token_ids, out.logprobs
        if not (seq.text.stop and len(ids) > 1):
            return seq.text.push(ids, final=final), ids, lps
        # NOTE: a speculative run (or a jump-forward) delivers several tokens at once; a stop
        # string completed inside it ends the sequence at that token, exactly as plain
        # decoding would have, so the tokens after it are neither shown nor counted.
        text = ""
        for i, t in enumerate(ids):
            text += seq.text.push([t], final=final and i == len(ids) - 1)
            if seq.text.stopped:
                return text, ids[: i + 1], (lps[: i + 1] if lps else lps)
        return text, ids, lps

    def _count_prompt(self, out: engine_ipc.SeqOutput) -> None:
        self._cached_seen.add(out.rid)
        part = self._part(out.rid)
        prompt = len(part.prompt_ids)
        # NOTE: a continuation's cache hit may cover its resumed output too; that output is not
        # a prompt token of the answer, so only the prompt's share counts as cached.
        cached = min(out.cached_tokens, prompt)
        self.usage.cached_tokens += cached
        self.metrics.on_prompt(prompt, cached, part.image_tokens)

    def _count_tokens(self, seq: _Seq, n: int) -> None:
        """Latency (time to first token, between tokens) and token counts for ``n`` new tokens."""
        now = time.monotonic()
        m = self.metrics.model_name
        if seq.tokens == 0:
            if self.first_token_time is None:
                self.first_token_time = now
                self.metrics.ttft.labels(m).observe(now - self.arrival)
        else:
            self.metrics.itl.labels(m).observe(now - seq.last_time)
        seq.last_time = now
        seq.tokens += n
        self.usage.completion_tokens += n
        self.metrics.generation_tokens.labels(m).inc(n)

    def _part(self, rid: str) -> Any:
        return next(p for p in self.handle.parts if p.rid == rid)

    def done(self) -> None:
        self.metrics.e2e.labels(self.metrics.model_name).observe(time.monotonic() - self.arrival)


# ---------------------------------------------------------------------- response bodies
def new_id(prefix: str, sep: str = "-") -> str:
    return f"{prefix}{sep}{uuid.uuid4().hex[:24]}"


def chat_logprobs(text: TextSide, lps: list[Logprob]) -> list[dict[str, Any]]:
    def entry(tid: int, lp: float | None) -> dict[str, Any]:
        return {"token": text.piece(tid), "logprob": lp, "bytes": text.piece_bytes(tid)}

    return [{**entry(x.token_id, x.logprob), "top_logprobs": [entry(t, v) for t, v in x.top]} for x in lps]


class CompletionLogprobs:
    """The legacy ``logprobs`` object of /v1/completions, built up token by token."""

    def __init__(self, text: TextSide, offset: int) -> None:
        self.text = text
        self.offset = offset  # characters before the first token (the echoed prompt)

    def body(self, lps: list[Logprob]) -> dict[str, Any]:
        """A None logprob (the prompt's first token, which nothing predicts) gives null
        ``token_logprobs`` and ``top_logprobs`` entries, as OpenAI does."""
        tokens: list[str] = []
        token_lps: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets: list[int] = []
        for x in lps:
            s = self.text.piece(x.token_id)
            tokens.append(s)
            token_lps.append(x.logprob)
            tops.append({self.text.piece(t): v for t, v in x.top} if x.logprob is not None else None)
            offsets.append(self.offset)
            self.offset += len(s)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def merge_logprobs(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two legacy logprobs objects, one after the other (echoed prompt, then the completion)."""
    return {k: a[k] + b[k] for k in a}


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


@dataclass(slots=True)
class Collected:
    texts: dict[int, list[str]] = field(default_factory=dict)
    logprobs: dict[int, list[Logprob]] = field(default_factory=dict)
    finish: dict[int, str | None] = field(default_factory=dict)
    stop_sequence: dict[int, str | None] = field(default_factory=dict)
    prompt_logprobs: dict[int, list[Logprob]] = field(default_factory=dict)
    token_ids: dict[int, list[int]] = field(default_factory=dict)
    weight_version: int | None = None  # the weights it ran on (Generation.weight_version)
    routed_experts: dict[int, list[list[list[int]]]] = field(default_factory=dict)  # Generation.routed_experts


class Collector:
    """Builds a whole answer's ``Collected`` from deltas, per choice (a continuation's choices
    starting with what they had produced)."""

    def __init__(self, gen: Generation) -> None:
        self.c = c = Collected()
        for seq in gen.seqs.values():
            c.texts[seq.index] = []
            c.logprobs[seq.index] = []
            c.finish[seq.index] = None
            c.token_ids[seq.index] = []
        for idx, prior in gen.priors.items():
            c.texts[idx] = [gen.prior_text.get(idx, "")]
            c.logprobs[idx] = list(prior.logprobs)
            c.finish[idx] = prior.finish_reason
            c.token_ids[idx] = list(prior.token_ids)

    def add(self, d: Delta) -> None:
        c = self.c
        c.texts[d.index].append(d.text)
        c.logprobs[d.index].extend(d.logprobs)
        c.token_ids[d.index].extend(d.token_ids)
        if d.finish_reason is not None:
            c.finish[d.index] = d.finish_reason
            c.stop_sequence[d.index] = d.stop_sequence
        if d.prompt_logprobs is not None:
            c.prompt_logprobs[d.index] = d.prompt_logprobs


async def collect(gen: Generation, it: AsyncIterator[Delta], first: Delta | None) -> Collected:
    """Gather the rest of ``it`` (``first`` was already taken from it) per choice."""
    col = Collector(gen)
    if first is not None:
        col.add(first)
    async for d in it:
        col.add(d)
    col.c.weight_version = gen.weight_version
    col.c.routed_experts = dict(gen.routed_experts)
    return col.c


def json_body(obj: dict[str, Any]) -> bytes:
    """A JSON answer's bytes, exactly as ``JSONResponse`` renders them."""
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode()


async def progress_stream(gen: Generation, it: AsyncIterator[Delta], first: Delta | None, rid: str, created: int,
                          body: Callable[[Collected], dict[str, Any]]) -> AsyncIterator[bytes]:
    """A whole answer for the router's failover (``tripod_failover``): an event stream of
    ``progress`` events (the answer's id and created, each delta's choice index, token ids, raw
    logprobs and finish reason), so the router knows what a replica that fails part-way had
    produced, then one ``result`` event holding the answer's exact bytes (or an ``error`` event)."""
    col = Collector(gen)
    try:
        deltas = [first] if first is not None else []
        while True:
            for d in deltas:
                col.add(d)
                yield b"event: progress\ndata: " + encode_progress(Progress(
                    rid, created, d.index, d.token_ids, d.logprobs, d.finish_reason)) + b"\n\n"
            nxt = await anext(it, None)
            if nxt is None:
                break
            deltas = [nxt]
        gen.done()
        answer = json_body(body(col.c))
    except APIError as e:
        yield b"event: error\ndata: " + json_body(e.body()) + b"\n\n"
        return
    yield b"event: result\ndata: " + answer + b"\n\n"
