"""The console's JSON API: typed models (pydantic), one per answer the page reads.

Times are Unix seconds (floats) so the page can place them on a clock; rates are per second;
shares are in [0, 1]; a value the source does not have (no requests in the window, no speculative
decoding configured) is ``None``, and the page leaves it out rather than drawing a zero.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

NodeState = Literal["healthy", "starting", "unhealthy", "draining", "down", "dead"]


class NodeView(BaseModel):
    """One server: a fleet's replica, or the one server of ``tripod serve``."""

    name: str
    url: str | None = None
    state: NodeState
    pid: int | None = None
    inflight: int = 0  # requests in flight to it (the router's count, or the server's own)
    inflight_tokens: float | None = None  # the router's estimate of their tokens (prompt not cached + output)
    running: int = 0  # sequences decoding (the server's own count)
    waiting: int = 0  # sequences queued in its engine
    routed: int | None = None  # requests the router sent it
    failures: int | None = None  # requests that failed on it
    restarts: int = 0
    cached_share: float | None = None  # share of prompt tokens served from its prefix cache (its own counters)
    estimated_cached_share: float | None = None  # the router's routing-time estimate of the same
    circuit: Literal["closed", "open"] | None = None  # the router's circuit breaker (None: no router)
    consecutive_failures: int | None = None
    kv_usage: float | None = None  # KV slots in use by requests (0-1)
    restart_in_s: float | None = None  # down: seconds until the supervisor relaunches it
    # Cache tiers and prefill/decode hand-overs (from its /metrics; None where it has none).
    role: str | None = None  # prefill | decode | both
    tier_hits_pool: float | None = None  # prompt tokens served from the pool (with a disk tier)
    tier_hits_disk: float | None = None  # … and from the disk tier
    kv_sent_bytes: float | None = None  # a prefill replica: KV handed over
    kv_received_bytes: float | None = None  # a decode replica: KV received and verified
    kv_transfer_s: float | None = None  # seconds spent sending (prefill) or receiving (decode) KV


class AutoscalerView(BaseModel):
    min_replicas: int
    max_replicas: int
    active: int  # replicas the supervisor keeps (starting ones included, draining ones not)
    desired: int  # the autoscaler's current wish (acted on after its delays)
    target_inflight: float


class FleetEvent(BaseModel):
    """Something that happened to the fleet, for the timeline."""

    t: float
    kind: Literal["state", "scale", "added", "removed"]
    node: str | None = None
    text: str


class FleetView(BaseModel):
    kind: Literal["server", "fleet"]
    t: float
    policy: str | None = None  # the router's routing policy
    pending: int = 0  # requests in the router (waiting + in flight)
    queue_depth: int = 0  # requests waiting for a routable replica
    nodes: list[NodeView]
    autoscaler: AutoscalerView | None = None
    events: list[FleetEvent] = Field(default_factory=list)
    pd: dict[str, float] | None = None  # the router's prefill/decode hand-overs (router/pd.py totals)


class SeriesPoint(BaseModel):
    """One server-side sample: rates and percentiles over the trailing window, gauges now."""

    t: float
    output_tok_s: float
    prompt_tok_s: float
    requests_s: float  # finished requests per second
    ttft_p50_ms: float | None = None  # None: no first token in the window
    ttft_p99_ms: float | None = None
    running: int
    queue_depth: int  # sequences waiting in engines + requests waiting in the router
    kv_usage: float | None = None  # mean over the nodes reporting it (0-1)
    kv_usage_max: float | None = None
    prefix_hit_rate: float | None = None  # cached / looked-up prompt tokens in the window
    jump_forward_acceptance: float | None = None  # accepted / proposed grammar-forced tokens
    spec_acceptance: float | None = None  # accepted / draft tokens (ngram, draft models, self)
    nodes_up: int
    nodes_desired: int | None = None


class Series(BaseModel):
    interval_s: float
    window_s: float
    points: list[SeriesPoint]


class TenantView(BaseModel):
    """One tenant since the process started (``tripod.tenants``' per-tenant series)."""

    name: str
    requests: int  # answered, any status
    by_status: dict[str, int]  # HTTP status → answers
    errors: int  # answers that were not 2xx (rejections included)
    prompt_tokens: int
    output_tokens: int
    rejections: dict[str, int]  # limit (requests_per_second, max_concurrent, ...) → requests refused
    ttft_p50_ms: float | None = None  # None: no first token yet (the router: first byte of the answer)
    ttft_p99_ms: float | None = None
    tpot_p50_ms: float | None = None
    tpot_p99_ms: float | None = None


class TenantsView(BaseModel):
    t: float
    source: Literal["server", "router"]  # whose counts: a server's, or a fleet's router's
    tenants: list[TenantView]


class ConsoleInfo(BaseModel):
    kind: Literal["server", "fleet"]
    model: str | None
    version: str
    interval_s: float
    window_s: float
    history_s: float
    bench_dir: str | None
    auth: bool  # the JSON API needs the API key (``Authorization: Bearer``)


# ---------------------------------------------------------------------------------- benchmarks
class BenchLevel(BaseModel):
    """One measured level of one target in a bench run (a point of its Pareto curve)."""

    target: str
    mode: str  # closed | open | trace
    dataset: str | None
    concurrency: int | None
    request_rate: float | None
    completed: int
    failed: int
    output_throughput: float
    output_throughput_per_machine: float
    interactivity: float | None  # tok/s per user = 1 / median TPOT
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    tpot_p50_ms: float | None
    cost_per_million_output_tokens: float | None = None
    # The level's own spread (see history.py): relative standard errors of its central values.
    output_throughput_rel_noise: float | None = None
    ttft_rel_noise: float | None = None


class BenchRun(BaseModel):
    """One ``tripod bench`` output folder (its results.json)."""

    id: str  # the folder, relative to the bench directory
    started: float  # Unix time the run started (its config; else the file's mtime)
    started_text: str
    model: str | None
    machines: int
    cost_per_hour: float | None
    isl: int | None = None  # the run's --isl / --osl (None for a trace: it replays recorded lengths)
    osl: int | None = None
    targets: list[str]
    levels: list[BenchLevel]


class SettingsKey(BaseModel):
    """What must be equal for two levels to be compared across runs."""

    target: str
    dataset: str | None
    mode: str
    concurrency: int | None
    request_rate: float | None
    isl: int | None
    osl: int | None
    model: str | None

    def label(self) -> str:
        load = f"C={self.concurrency}" if self.concurrency is not None else (
            f"{self.request_rate}/s" if self.request_rate is not None else self.mode)
        size = f" {self.isl}→{self.osl}" if self.isl is not None or self.osl is not None else ""
        return f"{self.target} · {self.dataset or '?'}{size} · {load}"


class HistoryPoint(BaseModel):
    run: str
    started: float
    output_throughput: float
    ttft_p50_ms: float | None
    throughput_noise: float  # relative noise used for this point (measured, or the default)
    ttft_noise: float
    noise_measured: bool  # False: the run recorded no spread and the default was used
    change: float | None = None  # relative change of tok/s vs the previous run (-0.2 = 20 % slower)
    ttft_change: float | None = None
    threshold: float | None = None  # the relative drop beyond which this point is flagged
    slower: bool = False  # tok/s below the previous run's beyond the noise of both
    ttft_worse: bool = False  # TTFT above the previous run's beyond the noise of both
    previous: str | None = None  # the run it was compared with


class HistorySeries(BaseModel):
    key: SettingsKey
    label: str
    points: list[HistoryPoint]


class SkippedRun(BaseModel):
    path: str
    why: str


class BenchIndex(BaseModel):
    dir: str | None
    runs: list[BenchRun]
    history: list[HistorySeries]
    skipped: list[SkippedRun] = Field(default_factory=list)
    message: str | None = None
