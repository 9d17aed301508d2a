"""The messages between the HTTP process and the engine process (ZMQ, msgpack).

Two PUSH/PULL pipes: server → engine carries ``AddRequest`` / ``AbortRequest`` /
``StatsRequest`` / ``Shutdown``; engine → server carries ``Ready``, ``Outputs`` (one message per
engine step), ``Heartbeat``, ``StatsReply`` and ``Fatal``. Every message is a dataclass; on the wire
it is ``[tag, fields...]`` in msgpack. The engine side speaks token ids only.

``AddRequest`` carries a ``SamplingParams``, built and validated once in the HTTP process
(``server/sampling.py``); on the wire it is its field values in declaration order (the grammar as
``[kind, value]``), and the engine side rebuilds the same dataclass. A continuation (the router's
failover) also carries the copies it resumes, each ``[index, output ids]`` (``Resume``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import msgpack

from tripod.engine.request import GrammarSpec, Resume, SamplingParams

_PARAM_FIELDS = [f.name for f in dataclasses.fields(SamplingParams)]


@dataclass(slots=True)
class AddRequest:
    rid: str  # the group id; copies are "{rid}-{i}" inside the engine when n > 1
    prompt_ids: list[int]
    params: SamplingParams
    # A continuation: only these copies run, each from the tokens it had generated. Empty: all n.
    resume: list[Resume] = field(default_factory=list)


class InvalidAddRequest(ValueError):
    """An ``AddRequest`` whose parameters do not validate on the engine side (a backstop: the
    server validated them with the same code). Carries what a rejection needs."""

    def __init__(self, rid: str, n: int, message: str) -> None:
        super().__init__(message)
        self.rid = rid
        self.n = n


@dataclass(slots=True)
class AbortRequest:
    rid: str  # a group id (every copy) or one copy's id


@dataclass(slots=True)
class StatsRequest:
    token: int  # echoed in the reply


@dataclass(slots=True)
class Shutdown:
    pass


@dataclass(slots=True)
class Ready:
    pid: int
    model_name: str
    dtype: str
    quantization: str
    architecture: str
    context_len: int
    max_request_len: int
    vocab_size: int
    max_running: int
    kv_slots: int
    # The compute backend at start-up ({"backend": "cpu", "isa": "avx2"}, or a torch backend and
    # why the kernels do not run); heartbeats carry its later value (the kernels may load later).
    compute: dict[str, Any]


@dataclass(slots=True)
class SeqOutput:
    """New tokens of one sequence (copy ``index`` of request ``rid``) from one engine step."""

    rid: str
    index: int
    token_ids: list[int]
    # Per new token: [chosen id, its logprob, [[id, logprob], ...] best first]; empty if not asked.
    logprobs: list[list[Any]] = field(default_factory=list)
    finish_reason: str | None = None
    cached_tokens: int = 0
    error: str | None = None
    # params.prompt_logprobs, with the sequence's first output: per prompt token
    # [id, logprob, top] as above, the first token's logprob None.
    prompt_logprobs: list[list[Any]] | None = None


@dataclass(slots=True)
class Outputs:
    items: list[SeqOutput]


@dataclass(slots=True)
class Heartbeat:
    stats: dict[str, Any]


@dataclass(slots=True)
class StatsReply:
    token: int
    stats: dict[str, Any]


@dataclass(slots=True)
class Fatal:
    message: str


_TYPES: list[type] = [
    AddRequest, AbortRequest, StatsRequest, Shutdown, Ready, Outputs, Heartbeat, StatsReply, Fatal,
]
_TAG = {cls: i for i, cls in enumerate(_TYPES)}


def _flat(obj: Any) -> Any:
    if isinstance(obj, SeqOutput):
        return [obj.rid, obj.index, obj.token_ids, obj.logprobs, obj.finish_reason, obj.cached_tokens, obj.error,
                obj.prompt_logprobs]
    if isinstance(obj, SamplingParams):
        return [_flat(getattr(obj, name)) for name in _PARAM_FIELDS]
    if isinstance(obj, GrammarSpec):
        return [obj.kind, obj.value]
    if isinstance(obj, Resume):
        return [obj.index, list(obj.output_ids)]
    if isinstance(obj, list) and obj and isinstance(obj[0], Resume):
        return [_flat(r) for r in obj]
    return obj


def _params(values: list[Any]) -> SamplingParams:
    fields = dict(zip(_PARAM_FIELDS, values, strict=True))
    g = fields.get("grammar")
    if g is not None:
        fields["grammar"] = GrammarSpec(*g)
    return SamplingParams(**fields)


def encode(msg: Any) -> bytes:
    cls = type(msg)
    values = [_flat(getattr(msg, f.name)) for f in dataclasses.fields(msg)]
    if cls is Outputs:
        values = [[_flat(it) for it in msg.items]]
    return msgpack.packb([_TAG[cls], *values], use_bin_type=True)


def decode(data: bytes) -> Any:
    tag, *values = msgpack.unpackb(data, raw=False, strict_map_key=False)
    cls = _TYPES[tag]
    if cls is Outputs:
        return Outputs([SeqOutput(*it) for it in values[0]])
    if cls is AddRequest:
        rid, prompt_ids, params, resume = values
        try:
            return AddRequest(rid, prompt_ids, _params(params), [Resume(int(i), tuple(ids)) for i, ids in resume])
        except (ValueError, TypeError) as e:
            n = params[_PARAM_FIELDS.index("n")]
            raise InvalidAddRequest(rid, n if isinstance(n, int) and 0 < n <= 128 else 1, str(e)) from None
    return cls(*values)
