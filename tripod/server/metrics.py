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
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

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
        labels = ["model_name"]
        self.http_requests = Counter(
            "tripod:http_requests", "HTTP answers by route and status", ["route", "status"], registry=r
        )
        self.request_success = Counter(
            "tripod:request_success", "finished sequences by finish reason",
            [*labels, "finished_reason"], registry=r,
        )
        self.prompt_tokens = Counter("tripod:prompt_tokens", "prompt tokens served", labels, registry=r)
        self.generation_tokens = Counter(
            "tripod:generation_tokens", "tokens generated", labels, registry=r
        )
        self.prefix_cache_hits = Counter(
            "tripod:prefix_cache_hits", "prompt tokens served from the prefix cache", labels, registry=r
        )
        self.prefix_cache_queries = Counter(
            "tripod:prefix_cache_queries", "prompt tokens looked up in the prefix cache", labels, registry=r
        )
        self.ttft = Histogram(
            "tripod:time_to_first_token_seconds", "time to first token", labels,
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.itl = Histogram(
            "tripod:inter_token_latency_seconds", "time between tokens of one sequence", labels,
            buckets=_ITL_BUCKETS, registry=r,
        )
        self.e2e = Histogram(
            "tripod:e2e_request_latency_seconds", "request latency, arrival to last token", labels,
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.running = Gauge("tripod:num_requests_running", "sequences decoding", labels, registry=r)
        self.waiting = Gauge("tripod:num_requests_waiting", "sequences queued", labels, registry=r)
        self.kv_usage = Gauge(
            "tripod:kv_cache_usage_perc", "KV slots in use by requests (0-1)", labels, registry=r
        )
        self.kv_cached = Gauge(
            "tripod:kv_cache_cached_tokens", "KV slots held by the prefix cache", labels, registry=r
        )
        self.engine_alive = Gauge("tripod:engine_alive", "1 while the engine loop is alive", registry=r)
        self.jf_accepted = Counter(
            "tripod:jump_forward_accepted_tokens", "grammar-forced tokens accepted by jump-forward", labels, registry=r
        )
        self.jf_proposed = Counter(
            "tripod:jump_forward_proposed_tokens", "grammar-forced tokens proposed for verification", labels,
            registry=r,
        )
        self.passes_saved = Counter(
            "tripod:forward_passes_saved", "decode forward passes saved (jump-forward)", labels, registry=r
        )
        # The heartbeat's "spec_decode" entries, in its order: [drafts, draft tokens, accepted tokens].
        self.spec_counters = tuple(
            Counter(f"tripod:spec_decode_num_{what}", doc, [*labels, "proposer"], registry=r)
            for what, doc in (
                ("drafts", "verification rounds that carried a speculative draft"),
                ("draft_tokens", "speculative draft tokens sent for verification"),
                ("accepted_tokens", "speculative draft tokens accepted (each saves a forward pass)"),
            )
        )
        self._engine_counts: dict[str, int] = {}

    def on_heartbeat(self, s: dict[str, Any]) -> None:
        m = self.model_name
        self.running.labels(m).set(s["running"])
        self.waiting.labels(m).set(s["waiting"])
        slots = max(1, s["kv_slots"])
        in_use = slots - s["kv_free"] - (s["kv_cached"] - s["kv_pinned"])
        self.kv_usage.labels(m).set(max(0, in_use) / slots)
        self.kv_cached.labels(m).set(s["kv_cached"])
        # The engine's counters are cumulative; add what is new since the last heartbeat.
        for key, counters in (("jump_forward_accepted", (self.jf_accepted, self.passes_saved)),
                              ("jump_forward_proposed", (self.jf_proposed,))):
            new = s.get(key, 0) - self._engine_counts.get(key, 0)
            if new > 0:
                for c in counters:
                    c.labels(m).inc(new)
            self._engine_counts[key] = s.get(key, 0)
        self._on_spec_decode(s.get("spec_decode") or {})

    def _on_spec_decode(self, spec: dict[str, list[int]]) -> None:
        m = self.model_name
        for proposer, values in spec.items():
            for i, (counter, value) in enumerate(zip(self.spec_counters, values, strict=True)):
                key = f"spec_decode/{proposer}/{i}"
                new = value - self._engine_counts.get(key, 0)
                if new > 0:
                    counter.labels(m, proposer).inc(new)
                self._engine_counts[key] = value

    def on_prompt(self, prompt_tokens: int, cached_tokens: int) -> None:
        m = self.model_name
        self.prompt_tokens.labels(m).inc(prompt_tokens)
        self.prefix_cache_queries.labels(m).inc(prompt_tokens)
        self.prefix_cache_hits.labels(m).inc(cached_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
