"""Chain calls: what crosses the network when a chainlet (or the server of a chain) calls another
chainlet's replica, and what the replicas ask the chain server.

The caller encodes, the callee decodes and validates. This layer types the envelopes only; the
values inside them (the arguments, the answer, each streamed item) are the callee's own types,
which pydantic checks against its ``run`` signature (``tripod.chains.signature``): they are the
user's own JSON here (``JSONObject``/``JSONValue``, ``tripod.protocol.json_value``).

- ``POST /run``: a ``ChainCall``, sent as the bare JSON object of the arguments by name. The answer
  is the return value as JSON; for a streaming chainlet ``text/event-stream`` with one ``data:``
  line of JSON per item, then ``event: end`` (``StreamEnd``) or, if it fails after it started,
  ``event: error`` (an ``ErrorBody``).
- A failure: an ``ErrorBody`` (an OpenAI-style error with ``chainlet``, ``path``, ``retryable``,
  ``detail`` and ``status``, so a caller one hop up rebuilds the error exactly) with its status.
- ``GET /chain/replicas`` of the chain server: a ``ReplicaList`` (how chainlets find each other).
- ``GET /health``: ``WorkerHealth`` from a replica, ``ChainHealth`` from the chain server;
  ``GET /chain``: ``ChainInfo``, the graph with each chainlet's contract and replicas.

Torch-free and pydantic-free: it imports msgspec only. The arguments and answers may hold NaN or
±Infinity as Python's ``json`` writes them (not JSON strictly, but what the peers always sent).
"""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator
from typing import TypeVar

import msgspec
from msgspec import UNSET, UnsetType

from tripod.protocol.fleet import ReplicaInfo
from tripod.protocol.json_value import JSONObject, JSONValue

T = TypeVar("T")

EVENT_END = "end"  # the SSE event that closes a stream
EVENT_ERROR = "error"  # the SSE event of a failure after the stream started


class ChainCall(msgspec.Struct, frozen=True):
    """One call: the callee's arguments by name, each value JSON-shaped. On the wire it is the bare
    object of ``args`` (no wrapper), so a plain ``curl -d '{"topic": "tides"}'`` is a call."""

    args: JSONObject  # the user's own: typed by the callee's parameters


class FieldError(msgspec.Struct, frozen=True):
    """One field that failed validation (pydantic's ``loc``, ``msg`` and ``type``)."""

    loc: list[str | int]
    msg: str
    type: str


class ErrorInfo(msgspec.Struct, kw_only=True):
    """The ``error`` object of a failed call. Every field has a default so that a partial body (an
    older peer, a proxy in between) still decodes; ``tripod.chains.errors`` fills the gaps from the
    answer's HTTP status. ``errors`` is left out of the body when there are none."""

    message: str = ""
    type: str = "server_error"
    param: str | None = None
    code: str = ""
    chainlet: str = ""
    path: list[str] = []
    retryable: bool | UnsetType = UNSET
    detail: str = ""
    status: int = 0
    errors: list[FieldError] | UnsetType = UNSET


class ErrorBody(msgspec.Struct):
    """A failed call's body: ``{"error": {...}}``."""

    error: ErrorInfo


class StreamEnd(msgspec.Struct):
    """The data of ``event: end``: how many items the stream delivered."""

    items: int


class ReplicaList(msgspec.Struct):
    """``GET /chain/replicas``: the routable replica URLs of each chainlet."""

    replicas: dict[str, list[str]]


class WorkerHealth(msgspec.Struct):
    """``GET /health`` of a chainlet's replica (200 while it takes calls, 503 once draining)."""

    status: str
    chainlet: str
    pid: int
    streaming: bool


class ChainHealth(msgspec.Struct):
    """``GET /health`` of the chain server: routable replicas of each chainlet and each model."""

    status: str
    entrypoint: str
    chainlets: dict[str, int]
    models: dict[str, int]


# --------------------------------------------------------------------------- GET /chain
ReplicaDescriptions = list[ReplicaInfo]  # each replica as its router describes it (its /fleet's shape)


class DependencyInfo(msgspec.Struct):
    """One ``chains.depends`` edge: the callee and how it is called."""

    chainlet: str
    retries: int
    timeout_s: float | None
    replicas: int


class LLMInfo(msgspec.Struct):
    """One ``chains.llm`` attribute: the model and the request defaults."""

    model: str
    defaults: JSONObject  # the user's own: chains.llm(model, **defaults)


class ChainletReplicas(msgspec.Struct):
    """A chainlet's replicas: how many are asked for and routable, each one as its router
    describes it, and the restarts of each slot."""

    desired: int
    routable: int
    list: ReplicaDescriptions  # NOTE: the field is named list, so the annotation cannot say list[...]
    restarts: dict[str, int]


class ChainletInfo(msgspec.Struct, kw_only=True):
    """One chainlet of ``GET /chain``: its contract (JSON schemas of its parameters and answer),
    its replicas, what it calls and which models it uses."""

    streaming: bool
    input_schema: JSONObject  # JSON schemas of the user's annotations
    output_schema: JSONObject | None
    replicas: ChainletReplicas
    dependencies: dict[str, DependencyInfo]
    llms: dict[str, LLMInfo]


class EntrypointInfo(msgspec.Struct):
    """How the chain server calls the entrypoint."""

    retries: int
    timeout_s: float | None


class ModelInfo(msgspec.Struct):
    """One model of ``GET /chain``: where it is served from and its replicas."""

    source: str
    routable_replicas: int
    replicas: ReplicaDescriptions


class ChainInfo(msgspec.Struct, kw_only=True):
    """``GET /chain``: the graph of a served chain."""

    entrypoint: str
    file: str
    backend: str
    streaming: bool
    entrypoint_options: EntrypointInfo
    chainlets: dict[str, ChainletInfo]
    models: dict[str, ModelInfo]


# --------------------------------------------------------------------------- the codec
def _str_hook(value: object) -> str:
    return str(value)  # as json.dumps(default=str): an odd value is sent as its text, not refused


_ENCODER = msgspec.json.Encoder(enc_hook=_str_hook)


def encode(msg: msgspec.Struct | JSONValue) -> bytes:
    """Any message of this module (or JSON-shaped data) as compact JSON."""
    return _ENCODER.encode(msg)


def decode(raw: bytes | str, into: type[T]) -> T:
    """``raw`` decoded and validated as ``into``; ``msgspec.DecodeError`` (a ``ValueError``; its
    subclass ``ValidationError`` for a well-formed body of the wrong shape) otherwise."""
    return msgspec.json.decode(raw, type=into)


def decode_value(raw: bytes | str) -> JSONValue:
    """An answer or one streamed item (or a call's arguments): JSON-shaped data, typed later by the
    callee's annotations. NaN and ±Infinity are read as Python's ``json`` writes them (a float the
    user's code returned); anything else that is not JSON raises ``ValueError``."""
    try:
        return msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return json.loads(raw)  # NOTE: the slow path, only for the non-finite constants


def _json_constants(value: JSONValue) -> object:
    """``value`` with NaN and ±infinity as the JSON extensions ``NaN``/``Infinity`` that Python's
    ``json`` writes and reads (msgspec would write ``null``, which a float parameter refuses)."""
    if isinstance(value, float) and not math.isfinite(value):
        return msgspec.Raw(b"NaN" if value != value else b"Infinity" if value > 0 else b"-Infinity")
    if isinstance(value, dict):
        return {k: _json_constants(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_constants(v) for v in value]
    return value


def encode_call(call: ChainCall) -> bytes:
    """The caller's side: the body of ``POST /run``."""
    return _ENCODER.encode(_json_constants(call.args))


def call_from_json(payload: JSONValue) -> ChainCall:
    """The callee's side, from a parsed JSON body: ``msgspec.ValidationError`` unless it is an
    object of arguments by name."""
    return ChainCall(msgspec.convert(payload, JSONObject))


def decode_call(raw: bytes) -> ChainCall:
    """The callee's side, from the raw body (empty: a call without arguments): ``ValueError`` when
    it is not JSON, ``msgspec.ValidationError`` when it is not an object of arguments by name."""
    return call_from_json(decode_value(raw)) if raw.strip() else ChainCall({})


# --------------------------------------------------------------------------- server-sent events
def sse_event(data: bytes, event: str | None = None) -> bytes:
    """One SSE event whose ``data`` is one line of encoded JSON."""
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + data + b"\n\n"


async def sse_events(lines: AsyncIterator[str]) -> AsyncIterator[tuple[str, str]]:
    """(event, data) of each SSE event in ``lines`` (the default event is ``message``)."""
    event, data = "message", list[str]()
    async for line in lines:
        if not line:
            if data:
                yield event, "\n".join(data)
            event, data = "message", list[str]()
        elif line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].lstrip(" "))
    if data:
        yield event, "\n".join(data)
