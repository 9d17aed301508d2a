"""The messages between the HTTP process and the engine process (ZMQ), and their one codec.

Two PUSH/PULL pipes: server → engine carries ``AddRequest`` / ``AbortRequest`` /
``StatsRequest`` / ``Shutdown`` / ``ExportKV`` and the RL controls (pause, continue, abort,
weight updates, sleep, wake, prefix-cache reset); engine → server carries ``Ready``, ``Outputs`` (one
message per engine step), ``Heartbeat``, ``StatsReply``, ``KVExport``, ``ControlReply`` and ``Fatal``. The engine side speaks token ids only.

Every message is a tagged ``msgspec.Struct``; on the wire it is a msgpack map with its fields by
name and ``"type"`` naming the message. ``decode`` reads any of them into its class and validates
it on the way: types, nested structs, and the ``__post_init__`` checks of ``SamplingParams`` and
``EngineStats``. ``AddRequest`` carries a ``SamplingParams`` built and validated once in the HTTP
process (``server/api/sampling.py``); decoding runs the same validation again as the engine's
backstop, and a request that fails it comes out as ``InvalidAddRequest`` (what a rejection needs:
the id and the number of copies), anything else malformed as ``ProtocolError``.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from tripod.config import EngineConfig
from tripod.protocol.multimodal import ImageInput, ImageSpan
from tripod.protocol.sampling import MAX_N, Resume, SamplingParams
from tripod.protocol.stats import ComputeCard, EngineStats


class Logprob(msgspec.Struct, array_like=True, frozen=True):
    """One token's logprob with the best alternatives at its position. On every wire (msgpack
    here, the failover JSON) it is ``[token id, logprob, [[token id, logprob], ...]]``.
    ``logprob`` is None only for a prompt's first token, which nothing predicts."""

    token_id: int
    logprob: float | None
    top: list[tuple[int, float]]  # best first; empty unless top logprobs were asked for


# ---------------------------------------------------------------------- server → engine
class AddRequest(msgspec.Struct, tag=True):
    rid: str  # the group id; copies are "{rid}-{i}" inside the engine when n > 1
    prompt_ids: list[int]
    params: SamplingParams
    # A continuation: only these copies run, each from the tokens it had generated. Empty: all n.
    resume: list[Resume] = msgspec.field(default_factory=list)
    # Fair share (engine/fairness.py): who asked, and that tenant's share under contention. ""
    # (no tenants) schedules exactly as before; the weight is checked on decode (> 0).
    tenant: str = ""
    weight: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    # Vision inputs (protocol/multimodal.py), in prompt order; each fills placeholder tokens of
    # prompt_ids. Empty: a text-only request.
    images: list[ImageInput] = msgspec.field(default_factory=list)


class AbortRequest(msgspec.Struct, tag=True):
    rid: str  # a group id (every copy) or one copy's id


class StatsRequest(msgspec.Struct, tag=True):
    token: int  # echoed in the reply


class Shutdown(msgspec.Struct, tag=True):
    pass


class ExportKV(msgspec.Struct, tag=True):
    """The whole blocks of ``prompt_ids`` the prefix cache holds, please (prefill/decode
    disaggregation: what a prefill replica sends on; ``memory/kv_transfer.py``)."""

    token: int  # echoed in the reply
    prompt_ids: list[int]
    # The prompt's images (a vision-language model keys their tokens by content): hash, offset, length.
    images: list[ImageSpan] = msgspec.field(default_factory=list)


class LoraRequest(msgspec.Struct, tag=True):
    """Load (``path`` given) or unload a LoRA adapter by name; answered by ``LoraReply(token)``."""

    token: int
    action: str  # "load" | "unload" | "list"
    name: str = ""
    path: str = ""


# RL control (``engine/rl_control.py``; the server's ``--enable-rl-api`` routes): each answered by a
# ``ControlReply`` carrying its token.
PAUSE_MODES = ("abort", "wait", "keep")


class PauseGeneration(msgspec.Struct, tag=True):
    """Stop generating: ``abort`` ends every request in flight (finish reason ``abort``), ``wait``
    lets them finish, ``keep`` freezes them where they are (their KV kept). New requests are held
    until ``ContinueGeneration`` in every mode."""

    token: int
    mode: str  # one of PAUSE_MODES; checked where it enters (the HTTP route) and by the engine


class ContinueGeneration(msgspec.Struct, tag=True):
    token: int


class AbortRequests(msgspec.Struct, tag=True):
    """End requests (finish reason ``abort``): these group ids, or every one when ``rids`` is empty."""

    token: int
    rids: list[str] = msgspec.field(default_factory=list)


class UpdateWeights(msgspec.Struct, tag=True):
    """New weights, applied between steps when no request holds state of the old ones: a folder or
    GGUF file (``model_path``), HF-named tensors as safetensors bytes (``safetensors``), or tensors
    broadcast over the weight group (``names``/``dtypes``/``shapes``)."""

    token: int
    model_path: str = ""
    safetensors: bytes = b""
    # From the weight group (InitWeightsGroup): the tensors rank 0 broadcasts, in this order.
    names: list[str] = msgspec.field(default_factory=list)
    dtypes: list[str] = msgspec.field(default_factory=list)
    shapes: list[list[int]] = msgspec.field(default_factory=list)


class InitWeightsGroup(msgspec.Struct, tag=True):
    """Join a trainer's torch.distributed group (it is rank 0) to receive weights over it."""

    token: int
    master_address: str
    master_port: Annotated[int, msgspec.Meta(gt=0, lt=65536)]
    rank: int
    world_size: Annotated[int, msgspec.Meta(ge=2)]
    backend: str = "gloo"


class Sleep(msgspec.Struct, tag=True):
    """Give memory back: level 1 the KV pool, level 2 the weights too (reloaded from disk on wake)."""

    token: int
    level: Annotated[int, msgspec.Meta(ge=1, le=2)] = 1


class WakeUp(msgspec.Struct, tag=True):
    token: int


class ResetPrefixCache(msgspec.Struct, tag=True):
    token: int


class RLState(msgspec.Struct, kw_only=True):
    """Where the engine stands: its weight version, its pause mode ("" running), its sleep level
    (0 awake) and the requests it holds (running or frozen / held back until it continues)."""

    weight_version: int
    paused: str = ""
    sleeping: int = 0
    in_flight: int = 0
    held: int = 0


class ControlReply(msgspec.Struct, tag=True):
    """The answer to an RL control message: ``error`` None (done), or why not, with ``kind``
    ``invalid`` (the caller's input: 400), ``conflict`` (not in this state: 409) or ``unsupported``
    (this model cannot: 400); ``aborted``: the sequences the message ended; ``released``: the bytes
    a sleep gave back (the KV pool's)."""

    token: int
    state: RLState
    error: str | None = None
    kind: str = ""
    aborted: int = 0
    released: int = 0


# ---------------------------------------------------------------------- engine → server
# Ready.architecture of an encoder engine (no generation): embeddings, or a cross-encoder's scores.
ENCODER_ARCHITECTURE = "BertModel"
CROSS_ENCODER_ARCHITECTURE = "BertForSequenceClassification"


class EmbedRequest(msgspec.Struct, tag=True):
    """Token lists for an encoder engine (no KV is kept): pooled into embeddings, or (``type_ids``
    given, a cross-encoder) each a pair scored; the reply's vectors are then ``[logit]`` each."""

    rid: str
    inputs: list[list[int]]
    type_ids: list[list[int]] | None = None


class Embeddings(msgspec.Struct, tag=True):
    """The reply to an ``EmbedRequest``: one vector per input, in order, or why there are none."""

    rid: str
    vectors: list[list[float]]
    error: str | None = None


class KVTierCard(msgspec.Struct, kw_only=True):
    """Where and how the engine's disk tier keeps blocks (``--kv-disk``; a decode replica's), so
    that its HTTP process can publish received blocks there."""

    dir: str  # DIR/<identity>
    identity: str  # hex
    num_layers: int
    row_shape: list[int]
    dtype: str  # torch dtype name, e.g. "float32"
    block_tokens: int
    state_bytes: int = 0  # a hybrid model's snapshot blocks: the state's bytes (0: no linear layers)


class Ready(msgspec.Struct, tag=True, kw_only=True):
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
    # The compute backend at start-up; heartbeats carry its later value (the kernels may load later).
    compute: ComputeCard
    kv_tier: KVTierCard | None = None  # with a disk tier (--kv-disk; --role decode)
    # LoRA adapters loaded at start-up (--lora): name -> path; None: this engine serves none.
    loras: dict[str, str] | None = None
    # The input kinds the model takes: ["text"], or ["text", "image"] for a vision-language model.
    modalities: list[str] = msgspec.field(default_factory=lambda: ["text"])
    # A hybrid model's recurrent state per sequence (float32 bytes; 0: no linear layers). A prefill
    # replica computes a hand-over's prompt but its last token then, so the state that travels is the
    # one a decode replica's admission resumes from (it computes the last token itself).
    state_bytes: int = 0
    # The quantization's format, bits, group size, activations and what computes them
    # (``loader/quant_card.py``); None: an unquantized checkpoint.
    quantization_detail: dict[str, Any] | None = None


class SeqTiming(msgspec.Struct, array_like=True, frozen=True):
    """When the engine did what for one sequence, in the engine process's ``time.monotonic()``
    (CLOCK_MONOTONIC: the same clock as the server's on one machine): added to the engine, first
    admitted to a batch (its prefill began), its first token, and finished (None until then).
    Reported only when the server asks at launch (``EngineLaunch.timings``: tracing is on), on a
    sequence's first output and on its last; the server makes the engine's spans from them."""

    arrival: float
    scheduled: float
    first_token: float | None = None
    finished: float | None = None


class SeqOutput(msgspec.Struct, kw_only=True):
    """New tokens of one sequence (copy ``index`` of request ``rid``) from one engine step."""

    rid: str
    index: int
    token_ids: list[int]
    logprobs: list[Logprob] = msgspec.field(default_factory=list)  # per new token; empty if not asked
    finish_reason: str | None = None
    cached_tokens: int = 0
    error: str | None = None
    # params.prompt_logprobs, with the sequence's first output: one per prompt token.
    prompt_logprobs: list[Logprob] | None = None
    timing: SeqTiming | None = None  # EngineLaunch.timings: on a sequence's first and last output
    # The weights it ran on (engine/rl_control.py): an update applies only when no request holds
    # state, so every output of one sequence carries the same version.
    weight_version: int = 0
    # params.return_routed_experts, with the sequence's last output: per computed position (prompt,
    # then output but the last token), per MoE layer, the top-k expert ids.
    routed_experts: list[list[list[int]]] | None = None


class Outputs(msgspec.Struct, tag=True):
    items: list[SeqOutput]


class Heartbeat(msgspec.Struct, tag=True):
    stats: EngineStats


class StatsReply(msgspec.Struct, tag=True):
    token: int
    stats: EngineStats


class LoraReply(msgspec.Struct, tag=True):
    """The answer to a ``LoraRequest``: its error (None: done), the adapters now loaded (name ->
    path), and the running requests still holding the adapter just unloaded."""

    token: int
    error: str | None
    loras: dict[str, str]
    running: int = 0


class Fatal(msgspec.Struct, tag=True):
    message: str


class KVExport(msgspec.Struct, tag=True):
    """The reply to ``ExportKV``: each block as the bytes of its disk-tier file, from block 0 on
    (empty when the tree holds none), or why none could be exported."""

    token: int
    blocks: list[bytes]
    error: str | None = None


Message = (AddRequest | AbortRequest | StatsRequest | Shutdown | LoraRequest | ExportKV | EmbedRequest | Ready | Outputs
           | Heartbeat | StatsReply | LoraReply | KVExport | Embeddings | Fatal | PauseGeneration | ContinueGeneration
           | AbortRequests | UpdateWeights | InitWeightsGroup | Sleep | WakeUp | ResetPrefixCache | ControlReply)
Control = (PauseGeneration | ContinueGeneration | AbortRequests | UpdateWeights | InitWeightsGroup | Sleep | WakeUp
           | ResetPrefixCache)


class ProtocolError(ValueError):
    """Bytes on an engine pipe that are no valid message (a bug or a version mismatch)."""


class InvalidAddRequest(ValueError):
    """An ``AddRequest`` whose parameters do not validate on the engine side (a backstop: the
    server validated them with the same code). Carries what a rejection needs."""

    def __init__(self, rid: str, n: int, message: str) -> None:
        super().__init__(message)
        self.rid = rid
        self.n = n


class _ParamsHead(msgspec.Struct):
    n: object = 1


class _AddHead(msgspec.Struct, tag="AddRequest"):
    """Only what a rejection needs, read leniently from an ``AddRequest`` that failed to decode."""

    rid: str
    params: _ParamsHead


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)
_head_decoder = msgspec.msgpack.Decoder(_AddHead)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> Message:
    """Bytes from a pipe → the message, validated. Raises ``InvalidAddRequest`` for a request
    that must be rejected, ``ProtocolError`` for anything else that is not a valid message."""
    try:
        return _decoder.decode(data)
    except msgspec.ValidationError as e:
        try:
            head = _head_decoder.decode(data)
        except msgspec.MsgspecError:
            raise ProtocolError(f"invalid engine message: {e}") from None
        n = head.params.n
        valid_n = n if isinstance(n, int) and not isinstance(n, bool) and 0 < n <= MAX_N else 1
        raise InvalidAddRequest(head.rid, valid_n, str(e)) from None
    except msgspec.DecodeError as e:
        raise ProtocolError(f"undecodable engine message: {e}") from None


class EngineLaunch(msgspec.Struct, kw_only=True):
    """What the server hands the engine process it spawns (JSON, its one argument): the engine's
    config, the two pipes, the heartbeat period, the log level and the parent to outlive not."""

    engine_config: EngineConfig
    to_engine: str
    from_engine: str
    heartbeat_interval: float
    log_level: int
    parent_pid: int
    timings: bool = False  # report each sequence's SeqTiming (tracing is on in the server)


def encode_launch(launch: EngineLaunch) -> str:
    return msgspec.json.encode(launch).decode()


def decode_launch(text: str) -> EngineLaunch:
    """The spawned engine's argument, validated (field types, then ``EngineConfig``'s own checks)."""
    try:
        return msgspec.json.decode(text, type=EngineLaunch)
    except msgspec.ValidationError as e:
        raise ProtocolError(f"bad engine launch spec: {e}") from e
