"""The router's failover extension as a replica reports it (JSON over HTTP).

A request with ``tripod_failover`` asks a tripod replica for resume points, so the router can
continue the answer on another replica if this one fails part-way (``tripod/router/failover.py``):

- a stream: the last chunk of each engine delta carries, per choice, ``"tripod": ResumePoint``
  (the router removes it before the client sees the chunk);
- a whole answer: an event stream of ``progress`` events (``Progress``, one per delta) ending in a
  ``result`` event with the answer's bytes.

The server builds these structs and encodes them; the router decodes them with ``decode_*``,
which validates (a replica that sends anything else is treated as failed, not misread).
"""

from __future__ import annotations

import msgspec

from tripod.protocol.engine_ipc import Logprob
from tripod.protocol.json_value import JSONObject, JSONValue


class ResumePoint(msgspec.Struct):
    """Where a stream's choice stands after this chunk: every token id of the delta it ends, and
    how many characters of the choice's text the client has been sent in all."""

    token_ids: list[int]
    chars: int

    def as_json(self) -> JSONObject:
        return msgspec.to_builtins(self)


class Progress(msgspec.Struct):
    """One delta of a whole answer: the answer's id and created, the choice, its new token ids
    with their raw logprobs (when asked for), and its finish reason once it has one."""

    id: str
    created: int
    index: int
    token_ids: list[int]
    logprobs: list[Logprob] = msgspec.field(default_factory=list)
    finish_reason: str | None = None


class MalformedExtension(ValueError):
    """A resume point or progress event that does not match its type."""


_progress_decoder = msgspec.json.Decoder(Progress)


def encode_progress(p: Progress) -> bytes:
    return msgspec.json.encode(p)


def decode_progress(data: str | bytes) -> Progress:
    try:
        return _progress_decoder.decode(data)
    except msgspec.MsgspecError as e:
        raise MalformedExtension(f"malformed progress event: {e}") from None


def decode_resume_point(obj: JSONValue) -> ResumePoint:
    """A chunk's ``"tripod"`` value (already parsed with the rest of the chunk) → its struct."""
    try:
        return msgspec.convert(obj, ResumePoint)
    except msgspec.ValidationError as e:
        raise MalformedExtension(f"malformed resume point: {e}") from None
