"""The engine's stats snapshot: what a ``Heartbeat`` and a ``StatsReply`` carry.

Built by the engine process (``engine/process.py``) from the engine's own counters, read by
attribute in the HTTP process (Prometheus metrics, ``/health``, ``/v1/models``, the console) and
served as JSON by ``/debug/engine``. ``version`` says which layout a snapshot has: a reader of
another version refuses it on decode instead of misreading a field.

The JSON of a snapshot (``EngineStats.as_json``) has the keys and nesting the engine's stats
always had (``spec_decode`` entries as ``[drafts, draft tokens, accepted tokens]``, ``consistent``
only in a reply to a stats query, ``inconsistency`` only when the check failed): tests, the
console and scripts read it by those names.
"""

from __future__ import annotations

import msgspec
from msgspec import UNSET, UnsetType

from tripod.protocol.json_value import JSONObject

STATS_VERSION = 2  # 2: ``vision`` (vision-language models' image counters)


class RankCard(msgspec.Struct, kw_only=True):
    rank: int
    weight_bytes: int  # the parameters this rank holds
    kv_bytes_per_token: int  # its KV pool's bytes per token slot
    kv_slots: int = 0  # the token slots its pool holds
    node: str = ""  # where it runs: the host name, or the Ray node id of a rank placed by Ray


class ParallelCard(msgspec.Struct, kw_only=True):
    tensor_parallel_size: int
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1  # data-parallel attention (MLA): each rank the KV of its own requests
    expert_parallel: bool
    ranks: list[RankCard]
    kv_capacity_tokens: int = 0  # the group's: tokens it can hold in KV at once


class ComputeCard(msgspec.Struct, kw_only=True):
    """What computes, as ``/v1/models`` reports it: ``{"backend": "cpu", "isa": "avx2"}``, or a
    torch backend with the reason tripod's kernels do not run (``reason``; present as null when
    nothing stops them but they are not in use yet). ``attention``: the kernels run the linears
    while torch runs attention (set only then). The Triton backend: ``interpret`` (its kernels
    run in Triton's interpreter on the CPU) and ``device``."""

    backend: str
    isa: str | None = None
    reason: str | UnsetType | None = UNSET
    attention: str | UnsetType = UNSET
    interpret: bool | UnsetType = UNSET
    device: str | UnsetType = UNSET
    # One model over several processes: {"tensor_parallel_size": T, "expert_parallel": bool,
    # "ranks": [{"rank", "weight_bytes", "kv_bytes_per_token"}, ...]} (set only then).
    parallel: ParallelCard | UnsetType = UNSET

    def as_json(self) -> JSONObject:
        return msgspec.to_builtins(self)  # unset keys are left out, as the engine's card leaves them


class SpecDecodeCounts(msgspec.Struct, array_like=True, frozen=True):
    """One proposer's cumulative speculative-decoding counts (JSON: ``[drafts, draft_tokens,
    accepted_tokens]``, the order ``ServerMetrics`` turns into ``tripod:spec_decode_num_*_total``)."""

    drafts: int
    draft_tokens: int
    accepted_tokens: int


class StepTimes(msgspec.Struct, kw_only=True):
    """Seconds the engine process spent in each part of its loop since start
    (``benchmarks/serve_profile.py`` reads them)."""

    schedule: float = 0.0
    prepare: float = 0.0
    decode_forward: float = 0.0
    prefill_forward: float = 0.0
    sample: float = 0.0
    bookkeeping: float = 0.0
    ipc: float = 0.0  # decoding incoming messages, encoding and sending outputs
    idle: float = 0.0  # waiting for messages with nothing to run


class DiskTierStats(msgspec.Struct, kw_only=True):
    """The prefix cache's disk tier (``--kv-disk``): where, how full, and what it served. Tokens
    served by the pool = ``prefix_hit_tokens`` - ``hit_tokens``."""

    dir: str
    capacity_bytes: int
    used_bytes: int  # the files this engine knows of (every engine's on the directory, as of its last scan)
    entries: int
    block_tokens: int
    hit_tokens: int = 0  # prompt tokens of first admissions served from the disk tier
    loaded_tokens: int = 0  # tokens loaded back into the pool (retried requests included)
    saved_tokens: int = 0  # tokens queued for writing (evicted from the pool, or saved at shutdown)
    written_blocks: int = 0
    written_bytes: int = 0
    dropped_blocks: int = 0  # not written: the write queue was full
    read_blocks: int = 0
    prefetched_blocks: int = 0  # read in the background while their request was queued
    corrupt_files: int = 0  # torn or corrupted files found, ignored and removed (never served)
    evicted_files: int = 0  # removed beyond the capacity (least recently used first)
    load_seconds: float = 0.0  # engine-loop time loading blocks into the pool
    save_seconds: float = 0.0  # engine-loop time copying evicted rows out for the writer


class VisionStats(msgspec.Struct, kw_only=True):
    """A vision-language engine's image counters (cumulative; ``images_held`` now)."""

    images_encoded: int = 0  # tower runs, one per distinct image content (not per request or copy)
    encoder_seconds: float = 0.0  # engine-loop time in the vision tower and projector
    image_tokens: int = 0  # image placeholder tokens of admitted prompts (in prompt_tokens too)
    encoder_cache_hits: int = 0  # images a request found encoded already (another copy's or request's)
    images_held: int = 0  # distinct images whose features the live requests hold now


class StateStats(msgspec.Struct, kw_only=True):
    """A hybrid (linear-attention) engine's recurrent-state memory: the state pool's slots now and
    the prefix cache's state snapshots (``memory/state_pool.py``, ``memory/state_snapshots.py``)."""

    slots: int
    free: int
    bytes_per_slot: int  # every linear layer's conv window and recurrent state, float32
    snapshot_slots: int = 0
    snapshots_held: int = 0
    snapshot_bytes: int = 0  # held now
    snapshots_taken: int = 0  # cumulative
    snapshots_restored: int = 0  # prefix-cache hits resumed from one


class EngineStats(msgspec.Struct, kw_only=True):
    """One snapshot of an engine: queues and KV slots now, cumulative counters since start.

    The queue and KV gauges are required (every snapshot has them); the counters default to 0
    so a snapshot of an engine that never used a feature (speculation, jump-forward) is plain."""

    version: int = STATS_VERSION
    running: int
    waiting: int
    kv_slots: int
    kv_free: int
    kv_cached: int  # slots held by the prefix cache ...
    kv_pinned: int  # ... of which pinned by running requests
    prefix_hit_tokens: int = 0
    prefix_query_tokens: int = 0
    generated_tokens: int = 0
    prompt_tokens: int = 0
    steps: int = 0
    retractions: int = 0
    jump_forward_proposed: int = 0
    jump_forward_accepted: int = 0
    prefill_tokens: int = 0
    spec_decode: dict[str, SpecDecodeCounts] = msgspec.field(default_factory=dict)  # per proposer
    compute: str = ""  # the compute path of the next step, in words
    compute_card: ComputeCard | None = None  # ... and as /v1/models reports it
    # Bytes of the model's weights held in memory (``executor/group.py``'s ``resident_weight_bytes``: parameters,
    # stored codes and the kernels' packed copies, each tensor once): with --weights stored, the stored
    # size. Set by an engine over a loaded model (left out of older snapshots' JSON).
    weight_bytes: int | UnsetType = UNSET
    time: StepTimes = msgspec.field(default_factory=StepTimes)
    kv_disk: DiskTierStats | UnsetType = UNSET  # set only with a disk tier (--kv-disk)
    vision: VisionStats | UnsetType = UNSET  # set only for a vision-language model
    states: StateStats | UnsetType = UNSET  # set only for a hybrid (linear-attention) model
    # A reply to a stats query only: the KV ownership invariant, checked when the engine is idle
    # (None: it was busy); ``inconsistency`` says what failed.
    consistent: bool | UnsetType | None = UNSET
    inconsistency: str | UnsetType = UNSET

    def __post_init__(self) -> None:
        if self.version != STATS_VERSION:
            raise ValueError(f"engine stats version {self.version}; this server reads version {STATS_VERSION} "
                             "(the engine process and the server must come from the same tripod)")

    def as_json(self) -> JSONObject:
        """The snapshot as ``/debug/engine`` serves it: the engine's keys, without ``version``
        (the endpoint's JSON predates it) and without the unset check fields."""
        out: JSONObject = msgspec.to_builtins(self)
        del out["version"]
        return out
