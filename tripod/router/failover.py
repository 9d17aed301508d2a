"""Mid-answer failover: what the router keeps of an answer so that another replica can continue it.

When the replica serving an OpenAI chat or completions request fails after the answer has begun
(connection cut, engine death, a 5xx error event, a stall), the router re-issues the request to
another replica as a *continuation*: the same body plus ``tripod_continuation`` — the answer's
``id`` and ``created`` and, per choice, the token ids produced so far (and, for a stream, how many
characters of its text the client has; for a whole answer, the raw logprobs and finish reasons).
The replica rebuilds every choice's state from its tokens (penalties, grammar, stop strings, the
seeded noise's position) and answers exactly as the first one would have, so the client's stream
simply goes on. Bounded by ``--max-retries`` continuations per request.

The router asks tripod replicas (``/health`` says ``"continuation": true``) for the resume points
with ``tripod_failover``: each stream chunk's choice then carries ``"tripod": {"token_ids",
"chars"}`` on the last chunk of each engine delta (the router removes it before the client sees
the chunk), and a whole answer comes as an event stream of ``progress`` events ending in a
``result`` event with the answer's bytes. Chunks of one delta are forwarded together, only once
its marked chunk has come, so what the client has is always exactly what the recorded tokens
produced: a cut between them loses nothing and duplicates nothing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import msgspec

from tripod.protocol.engine_ipc import Logprob
from tripod.protocol.failover import (
    MalformedExtension,
    ResumePoint,
    decode_progress,
    decode_resume_point,
)

FAILOVER_PATHS = ("/v1/chat/completions", "/v1/completions")
# Fields of tripod's protocol the router sets itself: a client's request that names one is
# passed through as it is, without failover.
PRIVATE_FIELDS = ("tripod_failover", "tripod_continuation")


def supports_failover(path: str, body: dict[str, Any]) -> bool:
    return path in FAILOVER_PATHS and not any(k in body for k in PRIVATE_FIELDS)


def dumps(obj: Any) -> bytes:
    """JSON as tripod's server writes it (so a chunk the router rewrites keeps its layout)."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


class SSESplitter:
    """Bytes as they come → complete server-sent events (each with its blank-line terminator)."""

    def __init__(self) -> None:
        self.buf = b""

    def feed(self, data: bytes) -> list[bytes]:
        self.buf += data
        out = []
        while (i := self.buf.find(b"\n\n")) >= 0:
            out.append(self.buf[: i + 2])
            self.buf = self.buf[i + 2 :]
        return out


def parse_event(raw: bytes) -> tuple[str, str]:
    """(event name, data) of one event ("message" when it names none)."""
    name, data = "message", []
    for line in raw.decode("utf-8", errors="replace").split("\n"):
        if line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
    return name, "\n".join(data)


def server_error(obj: Any) -> str | None:
    """The message of an error event that means the replica failed (a 5xx): worth continuing
    elsewhere. None for anything else."""
    err = obj.get("error") if isinstance(obj, dict) else None
    if isinstance(err, dict) and err.get("type") == "server_error":
        return str(err.get("message") or err.get("code") or "server error")
    return None


@dataclass(slots=True)
class ChoiceProgress:
    """What one choice has produced: for a stream, what the client has been sent."""

    token_ids: list[int] = field(default_factory=list)
    chars: int = 0  # characters of its text the client has (streams)
    logprobs: list[Logprob] = field(default_factory=list)  # per token (whole answers)
    finish_reason: str | None = None


class Failed(Exception):
    """The replica failed mid-answer (an error event, a stream that ended without ``[DONE]``)."""


@dataclass(slots=True)
class RelayStep:
    """What to do with one upstream event of a stream: ``send`` these bytes now (possibly none,
    while a delta's chunks are held), and whether the stream is over."""

    send: bytes = b""
    done: bool = False


class AnswerProgress:
    """One request's answer as far as it got, whichever replicas made it: owns the per-choice
    progress, the answer's id, and the events of a delta held until its resume point comes.

    Invariant (streams): ``choices`` holds exactly what the forwarded events carried, so a
    continuation built from it starts where the client's copy ends."""

    def __init__(self, body: dict[str, Any], stream: bool) -> None:
        self.body = body
        self.stream = stream
        self.id: str | None = None
        self.created: int | None = None
        self.choices: dict[int, ChoiceProgress] = {}
        self._held: list[bytes] = []
        self.continuations = 0  # continuation attempts made

    @property
    def started(self) -> bool:
        """Whether anything of the answer was recorded (else a failure is a plain retry)."""
        return self.id is not None

    # ---------------------------------------------------------------- requests
    def request_body(self) -> bytes:
        """The body for the next replica: the client's, with the resume points asked for and,
        once the answer has begun, the continuation."""
        body = dict(self.body)
        body["tripod_failover"] = True
        if self.started:
            choices = []
            for idx, c in sorted(self.choices.items()):
                ch: dict[str, Any] = {"index": idx, "token_ids": c.token_ids, "finish_reason": c.finish_reason}
                if self.stream:
                    ch["chars"] = c.chars
                elif c.token_ids and len(c.logprobs) == len(c.token_ids):
                    ch["logprobs"] = msgspec.to_builtins(c.logprobs)
                choices.append(ch)
            body["tripod_continuation"] = {"id": self.id, "created": self.created, "choices": choices}
        return dumps(body)

    def abandon_held(self) -> None:
        """The replica failed: the events held for an unfinished delta are never sent."""
        self._held.clear()

    # ---------------------------------------------------------------- streams
    def relay(self, raw: bytes) -> RelayStep:
        """One event of a stream → what to send the client now. Raises ``Failed`` on an error
        event that means the replica failed."""
        name, data = parse_event(raw)
        if data == "[DONE]":
            out, self._held = b"".join(self._held) + raw, []
            return RelayStep(out, done=True)
        try:
            obj = json.loads(data) if name == "message" and data else None
        except ValueError:
            obj = None
        if not isinstance(obj, dict):
            return self._flush(raw)
        why = server_error(obj)
        if why is not None:
            raise Failed(why)
        choices = obj.get("choices")
        if not isinstance(choices, list):
            return self._flush(raw)
        marks: list[tuple[int, ResumePoint, str | None]] = []
        complete = True
        for ch in choices:
            mark = ch.pop("tripod", None) if isinstance(ch, dict) else None
            if mark is None:
                complete = False
            else:
                marks.append((int(ch.get("index", 0)), _resume_point(mark), ch.get("finish_reason")))
        event = b"data: " + dumps(obj) + b"\n\n" if marks else raw
        if not complete:
            self._held.append(event)  # the rest of its delta comes with the resume point
            return RelayStep()
        if self.id is None:
            self.id, self.created = str(obj.get("id")), int(obj.get("created") or 0)
        for idx, mark, finish in marks:
            c = self.choices.setdefault(idx, ChoiceProgress())
            c.token_ids.extend(mark.token_ids)
            c.chars = mark.chars
            if finish is not None:
                c.finish_reason = str(finish)
        return self._flush(event)

    def _flush(self, event: bytes) -> RelayStep:
        out, self._held = b"".join(self._held) + event, []
        return RelayStep(out)

    # ---------------------------------------------------------------- whole answers
    def progress(self, raw: bytes) -> bytes | None:
        """One event of a whole answer's progress stream: records progress; the answer's bytes
        once its ``result`` comes. Raises ``Failed`` on an error event of a failed replica."""
        name, data = parse_event(raw)
        if name == "result":
            return data.encode()
        try:
            obj = json.loads(data)
        except ValueError:
            return None
        if name == "error":
            why = server_error(obj)
            raise Failed(why or f"the replica answered an error: {data[:300]}")
        if name != "progress":
            return None
        try:
            p = decode_progress(data)
        except MalformedExtension as e:
            raise Failed(str(e)) from None
        if self.id is None:
            self.id, self.created = p.id, p.created
        c = self.choices.setdefault(p.index, ChoiceProgress())
        c.token_ids.extend(p.token_ids)
        c.logprobs.extend(p.logprobs)
        if p.finish_reason is not None:
            c.finish_reason = p.finish_reason
        return None


def _resume_point(obj: Any) -> ResumePoint:
    try:
        return decode_resume_point(obj)
    except MalformedExtension as e:  # a replica that sends nonsense is treated as failed
        raise Failed(str(e)) from None
