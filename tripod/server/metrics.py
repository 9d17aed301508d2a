"""Prometheus metrics of one server.

Names follow vLLM's (``vllm:``) and SGLang's (``sglang:``) with a ``tripod:`` prefix so their
dashboards port by a find-and-replace: ``tripod:time_to_first_token_seconds``,
``tripod:inter_token_latency_seconds``, ``tripod:e2e_request_latency_seconds``,
``tripod:num_requests_running`` / ``_waiting``, ``tripod:kv_cache_usage_perc``,
``tripod:prefix_cache_hits_total`` (tokens), ``tripod:request_success_total{finished_reason}``,
and ``tripod:http_requests_total{route,status}`` for every answer, errors included.
Speculative decoding as vLLM counts it, per proposer (ngram, draft, self, jump_forward):
``tripod:spec_decode_num_drafts_total``, ``tripod:spec_decode_num_draft_tokens_total``,
``tripod:spec_decode_num_accepted_tokens_total`` {model_name, proposer}; acceptance rate =
accepted / draft tokens, mean accepted length = 1 + accepted / drafts.
With a disk tier under the prefix cache (``--kv-disk``): ``tripod:prefix_cache_tier_hits_total{tier=pool|disk}``
(prompt tokens served by each tier), ``tripod:kv_disk_usage_bytes``, ``tripod:kv_disk_capacity_bytes``,
``tripod:kv_disk_written_bytes_total``, ``tripod:kv_disk_corrupt_files_total``, ``tripod:kv_disk_evicted_files_total``,
``tripod:kv_disk_dropped_blocks_total``, ``tripod:kv_disk_load_seconds_total``.
Images (vision-language models): ``tripod:images_received_total{source=inline|url}``,
``tripod:images_refused_total{reason}`` (the 400's code), ``tripod:image_tokens_total`` (prompt
tokens that are images'), ``tripod:image_load_seconds`` (a request's images fetched, decoded and
processed); from the engine (``EngineStats.vision``): ``tripod:images_encoded_total`` (vision tower
runs: one per distinct image content), ``tripod:image_encoder_seconds_total``,
``tripod:image_encoder_cache_hits_total`` (images found encoded already), ``tripod:images_held``.
Hybrid (linear-attention / state-space) models, from the engine (``EngineStats.states``; no series
for other models): ``tripod:state_slots`` and ``tripod:state_slots_free`` (the state pool:
``--max-state-slots``), ``tripod:state_slot_bytes`` (one sequence's recurrent state),
``tripod:state_snapshot_slots`` (``--max-state-snapshots``), ``tripod:state_snapshots_held``,
``tripod:state_snapshot_bytes`` (held now), ``tripod:state_snapshots_taken_total`` and
``tripod:state_snapshots_restored_total`` (prefix-cache hits resumed from a snapshot).
Per tenant (``tripod.tenants.metrics``): ``tripod:tenant_requests_total{tenant,status}``,
``tripod:tenant_prompt_tokens_total``, ``tripod:tenant_output_tokens_total``,
``tripod:tenant_rejections_total{tenant,limit}``, ``tripod:tenant_time_to_first_token_seconds``,
``tripod:tenant_time_per_output_token_seconds``, ``tripod:tenant_file_reloads_total{result}``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tripod.protocol.stats import DiskTierStats, EngineStats, StateStats, VisionStats
from tripod.tenants.metrics import TenantMetrics

_LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0,
    7.5, 10.0, 20.0, 40.0, 80.0, 160.0,
)
_ITL_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
    0.3, 0.5, 0.75, 1.0, 2.5, 5.0,
)


class ServerMetrics:
    """Owns one registry (not the global one, so several servers can live in one test process)."""

    def __init__(self, model_name: str) -> None:
        self.registry = r = CollectorRegistry()
        self.model_name = model_name
        self.http_requests = Counter(
            "tripod:http_requests", "HTTP answers by route and status", ["route", "status"], registry=r
        )
        self.request_success = self._counter(
            "request_success", "finished sequences by finish reason", "finished_reason"
        )
        self.prompt_tokens = self._counter("prompt_tokens", "prompt tokens served")
        self.generation_tokens = self._counter("generation_tokens", "tokens generated")
        self.prefix_cache_hits = self._counter("prefix_cache_hits", "prompt tokens served from the prefix cache")
        self.prefix_cache_queries = self._counter(
            "prefix_cache_queries", "prompt tokens looked up in the prefix cache"
        )
        self.ttft = self._histogram("time_to_first_token_seconds", "time to first token", _LATENCY_BUCKETS)
        self.itl = self._histogram("inter_token_latency_seconds", "time between tokens of one sequence", _ITL_BUCKETS)
        self.e2e = self._histogram(
            "e2e_request_latency_seconds", "request latency, arrival to last token", _LATENCY_BUCKETS
        )
        self.running = self._gauge("num_requests_running", "sequences decoding")
        self.waiting = self._gauge("num_requests_waiting", "sequences queued")
        self.kv_usage = self._gauge("kv_cache_usage_perc", "KV slots in use by requests (0-1)")
        self.kv_cached = self._gauge("kv_cache_cached_tokens", "KV slots held by the prefix cache")
        self.engine_alive = Gauge("tripod:engine_alive", "1 while the engine loop is alive", registry=r)
        self.jf_accepted = self._counter(
            "jump_forward_accepted_tokens", "grammar-forced tokens accepted by jump-forward"
        )
        self.jf_proposed = self._counter(
            "jump_forward_proposed_tokens", "grammar-forced tokens proposed for verification"
        )
        self.passes_saved = self._counter("forward_passes_saved", "decode forward passes saved (jump-forward)")
        # The heartbeat's speculative-decoding counts, in their order: drafts, draft tokens, accepted tokens.
        self.spec_counters = (
            self._counter("spec_decode_num_drafts", "verification rounds that carried a speculative draft",
                          "proposer"),
            self._counter("spec_decode_num_draft_tokens", "speculative draft tokens sent for verification",
                          "proposer"),
            self._counter("spec_decode_num_accepted_tokens",
                          "speculative draft tokens accepted (each saves a forward pass)", "proposer"),
        )
        # The prefix cache per tier, and the disk tier (--kv-disk; from the heartbeat).
        self.tier_hits = self._counter("prefix_cache_tier_hits", "prompt tokens served from cache, by tier", "tier")
        self.disk_written = self._counter("kv_disk_written_bytes", "bytes written to the KV disk tier")
        self.disk_corrupt = self._counter("kv_disk_corrupt_files", "torn or corrupted KV disk tier files ignored")
        self.disk_evicted = self._counter("kv_disk_evicted_files", "KV disk tier files removed beyond its capacity")
        self.disk_dropped = self._counter("kv_disk_dropped_blocks", "evicted KV blocks not written (queue full)")
        self.disk_load_seconds = self._counter("kv_disk_load_seconds", "engine-loop seconds loading KV from disk")
        self.disk_used = self._gauge("kv_disk_usage_bytes", "bytes in the KV disk tier")
        self.disk_capacity = self._gauge("kv_disk_capacity_bytes", "capacity of the KV disk tier")
        # Images: received and refused here, encoded by the engine's vision tower (from the heartbeat).
        self.images_received = self._counter("images_received", "images in requests, by where their bytes were",
                                             "source")
        self.images_refused = self._counter("images_refused", "images refused with a 400, by its code", "reason")
        self.image_tokens = self._counter("image_tokens", "prompt tokens that are images' (in prompt_tokens too)")
        self.image_load_seconds = self._histogram("image_load_seconds", "a request's images fetched, decoded and "
                                                  "processed", _LATENCY_BUCKETS)
        self.images_encoded = self._counter("images_encoded", "images run through the engine's vision tower")
        self.encoder_seconds = self._counter("image_encoder_seconds", "engine seconds in the vision tower")
        self.encoder_hits = self._counter("image_encoder_cache_hits", "images a request found encoded already")
        self.images_held = self._gauge("images_held", "distinct images whose features live requests hold")
        # A hybrid model's recurrent-state memory (from the heartbeat): the pool and the prefix cache's snapshots.
        self.state_slots = self._gauge("state_slots", "recurrent-state slots of a hybrid model (sequences at once)")
        self.state_free = self._gauge("state_slots_free", "recurrent-state slots free")
        self.state_slot_bytes = self._gauge("state_slot_bytes", "bytes of one sequence's recurrent state "
                                            "(every linear layer's conv window + state)")
        self.snapshot_slots = self._gauge("state_snapshot_slots", "state snapshots the prefix cache may hold")
        self.snapshots_held = self._gauge("state_snapshots_held", "state snapshots the prefix cache holds")
        self.snapshot_bytes = self._gauge("state_snapshot_bytes", "bytes of the state snapshots held")
        self.snapshots_taken = self._counter("state_snapshots_taken", "state snapshots taken on prefix-cache nodes")
        self.snapshots_restored = self._counter("state_snapshots_restored",
                                                "prefix-cache hits resumed from a state snapshot")
        self._engine_counts: dict[str, float] = {}
        self.tenants = TenantMetrics(r, "tripod:tenant_")  # per tenant (tripod.tenants)

    # Every series but the HTTP answers is labelled with the model's name first (vLLM's layout).
    def _counter(self, name: str, doc: str, *labels: str) -> Counter:
        return Counter(f"tripod:{name}", doc, ["model_name", *labels], registry=self.registry)

    def _gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(f"tripod:{name}", doc, ["model_name"], registry=self.registry)

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(f"tripod:{name}", doc, ["model_name"], buckets=buckets, registry=self.registry)

    def on_heartbeat(self, s: EngineStats) -> None:
        m = self.model_name
        self.running.labels(m).set(s.running)
        self.waiting.labels(m).set(s.waiting)
        slots = max(1, s.kv_slots)
        in_use = slots - s.kv_free - (s.kv_cached - s.kv_pinned)
        self.kv_usage.labels(m).set(max(0, in_use) / slots)
        self.kv_cached.labels(m).set(s.kv_cached)
        # The engine's counters are cumulative; add what is new since the last heartbeat.
        self._add_new("jump_forward_accepted", s.jump_forward_accepted, (self.jf_accepted, self.passes_saved), m)
        self._add_new("jump_forward_proposed", s.jump_forward_proposed, (self.jf_proposed,), m)
        if isinstance(s.kv_disk, DiskTierStats):
            d = s.kv_disk
            self._add_new("tier/disk", d.hit_tokens, (self.tier_hits,), m, "disk")
            self._add_new("tier/pool", s.prefix_hit_tokens - d.hit_tokens, (self.tier_hits,), m, "pool")
            self._add_new("disk/written", d.written_bytes, (self.disk_written,), m)
            self._add_new("disk/corrupt", d.corrupt_files, (self.disk_corrupt,), m)
            self._add_new("disk/evicted", d.evicted_files, (self.disk_evicted,), m)
            self._add_new("disk/dropped", d.dropped_blocks, (self.disk_dropped,), m)
            self._add_new("disk/load", d.load_seconds, (self.disk_load_seconds,), m)
            self.disk_used.labels(m).set(d.used_bytes)
            self.disk_capacity.labels(m).set(d.capacity_bytes)
        if isinstance(s.vision, VisionStats):  # (a vision-language model's engine)
            v = s.vision
            self._add_new("vision/encoded", v.images_encoded, (self.images_encoded,), m)
            self._add_new("vision/seconds", v.encoder_seconds, (self.encoder_seconds,), m)
            self._add_new("vision/hits", v.encoder_cache_hits, (self.encoder_hits,), m)
            self.images_held.labels(m).set(v.images_held)
        if isinstance(s.states, StateStats):  # (a hybrid model's engine)
            self._on_states(s.states)
        for proposer, counts in s.spec_decode.items():
            values = (counts.drafts, counts.draft_tokens, counts.accepted_tokens)
            for i, (counter, value) in enumerate(zip(self.spec_counters, values, strict=True)):
                self._add_new(f"spec_decode/{proposer}/{i}", value, (counter,), m, proposer)

    def _on_states(self, st: StateStats) -> None:
        m = self.model_name
        for gauge, value in ((self.state_slots, st.slots), (self.state_free, st.free),
                             (self.state_slot_bytes, st.bytes_per_slot), (self.snapshot_slots, st.snapshot_slots),
                             (self.snapshots_held, st.snapshots_held), (self.snapshot_bytes, st.snapshot_bytes)):
            gauge.labels(m).set(value)
        self._add_new("states/taken", st.snapshots_taken, (self.snapshots_taken,), m)
        self._add_new("states/restored", st.snapshots_restored, (self.snapshots_restored,), m)

    def _add_new(self, key: str, total: float, counters: tuple[Counter, ...], *labels: str) -> None:
        """Add to ``counters`` what the engine's cumulative ``total`` under ``key`` gained since
        the last heartbeat (a series appears once it has counted something)."""
        new = total - self._engine_counts.get(key, 0)
        if new > 0:
            for c in counters:
                c.labels(*labels).inc(new)
        self._engine_counts[key] = total

    def on_prompt(self, prompt_tokens: int, cached_tokens: int, image_tokens: int = 0) -> None:
        m = self.model_name
        self.prompt_tokens.labels(m).inc(prompt_tokens)
        if image_tokens:
            self.image_tokens.labels(m).inc(image_tokens)
        self.prefix_cache_queries.labels(m).inc(prompt_tokens)
        self.prefix_cache_hits.labels(m).inc(cached_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
