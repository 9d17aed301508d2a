"""The configs of the processes around an engine: ``tripod serve``'s HTTP side (``ServerConfig``),
the router (``RouterConfig``) and a fleet (``FleetConfig``). Declared like ``EngineConfig`` (each
command-line option with ``opt(...)``); ``tripod.config`` re-exports them."""

from __future__ import annotations

import ipaddress
import json
import re
from dataclasses import dataclass

from tripod.config_cli import opt
from tripod.config_commands import BENCH_DIR_HELP, CHAINS_SERVE, ROUTE, SERVE

OTEL_ENDPOINT_HELP = ("trace requests with OpenTelemetry, exporting spans over OTLP/HTTP to this collector (e.g. "
                      "http://localhost:4318; needs opentelemetry-exporter-otlp-proto-http)")
OTEL_FILE_HELP = "trace requests with OpenTelemetry, appending the spans to this file (one JSON object per line)"


def check_tls(certfile: str | None, keyfile: str | None) -> None:
    """HTTPS needs both the certificate and its key."""
    if (certfile is None) != (keyfile is None):
        raise ValueError("--ssl-certfile and --ssl-keyfile go together: give both for HTTPS, or neither")


# The request body limit (--max-body-bytes) of servers and routers: room for a few inline images
# (base64 adds a third) beside the text; 413 past it.
MAX_BODY_BYTES = 32 * 2**20


def media_domains(value: str | None) -> tuple[str, ...]:
    """``--allowed-media-domains`` (hosts, comma-separated) as lower-case patterns: a host name or
    IPv4 address, an IPv6 address in brackets, or ``*.name`` for every subdomain of name; a
    ValueError naming a bad entry."""
    if not value:
        return ()
    out = []
    for raw in value.split(","):
        host = raw.strip().lower()
        if host.startswith("[") and host.endswith("]"):  # an IPv6 address, as URLs write it
            try:
                out.append(str(ipaddress.IPv6Address(host[1:-1])))
            except ValueError:
                raise ValueError(f"{raw.strip()!r} is not an IPv6 address") from None
            continue
        name = host[2:] if host.startswith("*.") else host
        if not name or any(c in name for c in "/:@?#* ") or name.startswith(".") or name.endswith("."):
            raise ValueError(f"{raw.strip()!r} is not a host name (give names such as "
                             "images.example.com or *.example.com, without scheme, port or path)")
        out.append(host)
    return tuple(out)


def mm_limit(value: str) -> int:
    """``--limit-mm-per-prompt``: images per request, as ``N``, ``image=N`` or vLLM's JSON
    ``{"image": N}``. Other modalities are taken only at 0 (tripod takes images alone); a
    ValueError saying what to write."""
    text = value.strip()
    pairs: dict[str, object]
    if text.startswith("{"):
        try:
            pairs = dict(json.loads(text))
        except (ValueError, TypeError):
            raise ValueError(f"{value!r} is not a JSON object; write N, image=N or '{{\"image\": N}}'") from None
    elif "=" in text:
        pairs = {}
        for item in text.split(","):
            key, _, n = item.partition("=")
            pairs[key.strip()] = n.strip()
    else:
        pairs = {"image": text}
    out = 0
    for key, n in pairs.items():
        digits = str(n).strip()
        if isinstance(n, bool) or not re.fullmatch(r"-?[0-9]+", digits):
            raise ValueError(f"{key}: {n!r} is not a whole number of items; write N, image=N or '{{\"image\": N}}'")
        count = int(digits)
        if key == "image":
            out = count
        elif count:
            raise ValueError(f"{key!r} inputs are not taken (images only): give {key} 0 or leave it out")
    if out < 0:
        raise ValueError(f"the image limit must be >= 0 (got {out})")
    return out


PD_ROLES = ("both", "prefill", "decode")  # --role: server/api/pd.py


def check_pd_role(role: str, enable_prefix_cache: bool, world_size: int) -> None:
    """What ``--role prefill|decode`` cannot combine with (a ValueError that says what to change)."""
    if role == "both":
        return
    if not enable_prefix_cache:
        raise ValueError(f"--role {role} hands a prompt's KV over through the prefix cache: it cannot be combined "
                         "with --no-prefix-cache")
    if world_size > 1:
        raise ValueError(f"--role {role} is not built for a model over several processes (each rank holds a shard "
                         "of the KV); drop --tensor/pipeline/data-parallel-size or --role")

# --reasoning-parser: auto (from the model's architecture and chat template), none, or a parser
# (tripod/server/answer/reasoning.py keeps the parsers by these names).
REASONING_PARSERS = ("auto", "none", "deepseek_r1", "qwen3", "gpt_oss")


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """The HTTP side of ``tripod serve``: where it listens, who may call it, how it sheds load."""

    host: str = opt("127.0.0.1", "address to listen on (default: loopback only)", commands=(SERVE, CHAINS_SERVE),
                    forward=False)
    port: int = opt(8000, "port to listen on", commands=(SERVE, CHAINS_SERVE), forward=False)
    api_key: str | None = opt(  # when set, every route but the open ones (server/app.py guarded_path) needs it
        None, "require KEY ('Authorization: Bearer KEY', or Anthropic's 'x-api-key: KEY') on every route but "
        "/health, /metrics, /openapi.json and the console's page shell (default: $TRIPOD_API_KEY)", commands=(SERVE,),
        env="TRIPOD_API_KEY")
    served_model_name: str | None = opt(  # None: the model's own name
        None, "the model id clients use (default: the model's name)", commands=(SERVE,))
    max_waiting: int = opt(  # sequences queued beyond max_running; past it: overload_status
        256, "sequences that may wait beyond --max-running before new requests are refused", commands=(SERVE,))
    overload_status: int = opt(
        429, "status for refused requests when the queue is full", commands=(SERVE,), choices=(429, 503))
    retry_after: int = 1  # seconds, sent with overload and drain refusals
    drain_timeout: float = opt(  # SIGTERM: seconds in-flight requests get to finish
        30.0, "seconds in-flight requests get to finish after SIGTERM", commands=(SERVE, ROUTE, CHAINS_SERVE))
    max_body_bytes: int = opt(
        MAX_BODY_BYTES, "largest request body in bytes (413 past it); images sent inline (base64) count in it",
        commands=(SERVE,), metavar="BYTES")
    max_n: int = opt(16, "largest 'n' a request may ask for", commands=(SERVE,))
    reasoning_parser: str = opt(  # how the thinking is split from the answer (docs/serving.md "Reasoning output")
        "auto", "split the model's thinking out of its answer (reasoning_content, thinking blocks): auto (from "
        "the model's architecture and chat template), none, or a parser", commands=(SERVE,), metavar="NAME|none",
        choices=REASONING_PARSERS)
    heartbeat_interval: float = 0.5  # engine → server
    heartbeat_timeout: float = 30.0  # no heartbeat this long: the engine is hung
    engine_start_timeout: float = 600.0
    # After the engine dies: seconds to keep answering 503 (so health checkers see it) before exit.
    dead_grace: float = 2.0
    bench_dir: str | None = opt(  # the console's benchmark history: where tripod bench wrote its runs
        None, BENCH_DIR_HELP, commands=(SERVE,), metavar="DIR", group="console", forward=False)
    # Prefill/decode disaggregation (server/api/pd.py; docs/kv.md "Prefill/decode disaggregation"). A fleet
    # gives each replica its role (--prefill-replicas), so it is not forwarded.
    role: str = opt(
        "both", "prefill/decode disaggregation: prefill (a router sends it new prompts; it computes their KV and "
        "hands it to a decode replica) or decode (receives prompts' KV into its disk tier: --kv-disk, or a private "
        "one in /dev/shm, and generates); both = an ordinary replica", commands=(SERVE,),
        choices=PD_ROLES, forward=False)

    # The Responses API's store (server/response_store.py; docs/serving.md "Responses API"). A fleet forwards it, so
    # replicas given one sqlite file share their stored responses.
    responses_store: str = opt("memory", "where /v1/responses keeps stored responses: memory (bounded, lost at exit) "
                               "or sqlite:PATH (durable, shared by the processes that open it)", commands=(SERVE,),
                               metavar="memory|sqlite:PATH", group="responses")
    responses_ttl: float = opt(86400.0, "seconds a stored response is kept", commands=(SERVE,), group="responses")
    responses_max_count: int = opt(10000, "the memory store's cap on responses (least recently used evicted)",
                                   commands=(SERVE,), group="responses")
    responses_max_bytes: int = opt(256 * 2**20, "the memory store's cap on bytes (least recently used evicted)",
                                   commands=(SERVE,), group="responses")

    # Tenants, audit log and TLS (tripod.tenants; docs/tenants.md); audit/TLS are not forwarded to replicas.
    tenants: str | None = opt(None, "a TOML file of tenants: keys, weights, limits (reloaded on SIGHUP and on change)",
                              commands=(SERVE,), metavar="FILE", group="tenants")
    tenant_limits: str = opt("all", "tenant limits enforced here: all; tokens (token limits and max_context only); "
                             "none (attribution only: a router with --tenants enforces them)", commands=(SERVE,), choices=("all", "tokens", "none"), group="tenants")
    audit_log: str | None = opt(None, "one JSON line per authenticated request (rotated by size)", commands=(SERVE,),
                                metavar="FILE", group="tenants", forward=False)
    audit_log_content: bool = opt(False, "put the prompt's text in the audit log", commands=(SERVE,), group="tenants",
                                  forward=False)
    audit_log_max_bytes: int = 64 * 2**20  # rotated past this size, 5 old files kept
    ssl_certfile: str | None = opt(None, "serve HTTPS with this PEM certificate", commands=(SERVE,), metavar="FILE",
                                   group="tenants", forward=False)
    ssl_keyfile: str | None = opt(None, "its PEM private key", commands=(SERVE,), metavar="FILE", group="tenants",
                                  forward=False)
    # Images in requests (server/media; docs/serving.md "Vision"): forwarded, so every replica takes the same.
    limit_mm_per_prompt: int = opt(8, "images one request may hold (its whole conversation); more: 400. "
                                   "Also taken as vLLM spells it: image=N or '{\"image\": N}'",
                                   commands=(SERVE,), metavar="N", group="vision", parse=mm_limit)
    allowed_media_domains: str | None = opt(
        None, "hosts whose http(s) image URLs the server fetches (exact names; *.example.com for its subdomains; "
        "redirects must stay among them); default: none, data: URLs only", commands=(SERVE,), metavar="HOST",
        join=",", check=lambda v: media_domains(v), group="vision")
    media_fetch_timeout: float = opt(10.0, "seconds an image URL fetch may take in all (redirects included)",
                                     commands=(SERVE,), metavar="S", group="vision")
    max_image_bytes: int = opt(20 * 2**20, "largest image in bytes (encoded, as sent or fetched)", commands=(SERVE,),
                               metavar="BYTES", group="vision")
    max_image_pixels: int = opt(40_000_000, "largest image in pixels (width x height; decompression bombs are "
                                "refused before they are decoded)", commands=(SERVE,), metavar="N", group="vision")

    # Tracing (tripod.tracing; docs/console.md "Tracing"): a fleet's replicas trace too (forwarded).
    otel_endpoint: str | None = opt(None, OTEL_ENDPOINT_HELP, commands=(SERVE, CHAINS_SERVE), metavar="URL",
                                    group="tracing")
    otel_file: str | None = opt(None, OTEL_FILE_HELP, commands=(SERVE, CHAINS_SERVE), metavar="FILE", group="tracing")

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535] (got {self.port})")
        if self.overload_status not in (429, 503):
            raise ValueError(f"overload_status must be 429 or 503 (got {self.overload_status})")
        if self.max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0 (got {self.max_waiting})")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty")
        for name in ("drain_timeout", "heartbeat_interval", "heartbeat_timeout", "engine_start_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0 (got {getattr(self, name)})")
        if self.heartbeat_timeout <= self.heartbeat_interval:
            raise ValueError("heartbeat_timeout must be longer than heartbeat_interval")
        if self.max_n < 1 or self.max_body_bytes < 1024:
            raise ValueError("max_n must be >= 1 and max_body_bytes >= 1024")
        check_tls(self.ssl_certfile, self.ssl_keyfile)
        if self.role not in PD_ROLES:
            raise ValueError(f"role must be one of {', '.join(PD_ROLES)} (got {self.role!r})")
        if self.responses_store != "memory" and not (self.responses_store.startswith("sqlite:")
                                                     and len(self.responses_store) > len("sqlite:")):
            raise ValueError(f"responses_store must be 'memory' or 'sqlite:PATH' (got {self.responses_store!r})")
        if self.responses_ttl <= 0 or self.responses_max_count < 1 or self.responses_max_bytes < 1:
            raise ValueError("responses_ttl must be > 0, responses_max_count and responses_max_bytes >= 1")
        if self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)} "
                             f"(got {self.reasoning_parser!r})")
        if self.limit_mm_per_prompt < 0 or self.max_image_bytes < 1 or self.max_image_pixels < 1:
            raise ValueError("limit_mm_per_prompt must be >= 0, max_image_bytes and max_image_pixels >= 1")
        if self.media_fetch_timeout <= 0:
            raise ValueError(f"media_fetch_timeout must be > 0 (got {self.media_fetch_timeout})")
        try:
            media_domains(self.allowed_media_domains)
        except ValueError as e:
            raise ValueError(f"allowed_media_domains: {e}") from None

    @property
    def media_hosts(self) -> tuple[str, ...]:
        """``allowed_media_domains`` as checked, lower-case host patterns."""
        return media_domains(self.allowed_media_domains)


ROUTING_POLICIES = ("cache_aware", "least_load", "round_robin")


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """``tripod route``: how the router picks a replica, watches replicas and sheds load."""

    # In `tripod serve` (a fleet) the router listens where the server would: --host/--port are
    # ServerConfig's options there, as are --api-key and --bench-dir (see config_cli.from_namespace).
    host: str = opt("127.0.0.1", "address to listen on (default: loopback only)", commands=(ROUTE,))
    port: int = opt(8000, "port to listen on", commands=(ROUTE,))
    policy: str = opt(  # cache_aware | least_load | round_robin
        "cache_aware", "how a replica is picked", commands=(SERVE, ROUTE, CHAINS_SERVE), flag="--router-policy",
        flags=((ROUTE, "--policy"),), dest="router_policy", choices=ROUTING_POLICIES)
    # cache_aware: cost = (prompt tokens the replica would not find cached) + load_weight × (its load
    # in tokens). balance_abs/balance_rel: a replica whose in-flight requests exceed
    # balance_rel × (the least loaded one's) + balance_abs is not chosen for its cache.
    load_weight: float = opt(
        1.0, "cache_aware: cost of one token of a replica's load vs one uncached prompt token", commands=(SERVE, ROUTE))
    balance_abs: int = opt(
        4, "cache_aware guard: a replica with more than balance-rel x (least in-flight) + balance-abs requests in "
        "flight is not chosen for its cache", commands=(SERVE, ROUTE))
    balance_rel: float = opt(1.5, "see --balance-abs", commands=(SERVE, ROUTE))
    min_match_tokens: float = 16.0  # a cached prefix shorter than this does not steer a request
    # Prefill/decode disaggregation (router/pd.py): a prompt the decode replica probably lacks fewer
    # tokens of than this is not handed to a prefill replica (a follow-up turn: little to compute).
    pd_min_uncached_tokens: float = 64.0
    tree_max_chars: int = 2_000_000  # per replica
    chars_per_token: float = 4.0  # first estimate; refined from the usage replicas report
    health_interval: float = opt(  # seconds between /health probes of each replica
        1.0, "seconds between health probes", commands=(SERVE, ROUTE))
    health_timeout: float = 2.0
    metrics_interval: float = 2.0  # seconds between /metrics scrapes (load refresh)
    failure_threshold: int = 3  # consecutive errors that open a replica's circuit
    open_cooldown: float = 2.0  # an open circuit closes on the first good probe after this long
    # A request that fails before its first token: other replicas to try; one that fails after it
    # (OpenAI chat/completions on tripod replicas): continuations on other replicas, at most this many.
    max_retries: int = opt(
        2, "other replicas tried when one fails before the answer starts; and continuations of an answer "
        "(OpenAI chat/completions) on another replica when its replica fails mid-answer", commands=(SERVE, ROUTE))
    stall_timeout: float = opt(  # an answer silent this long mid-way: its replica is failing (continue elsewhere)
        30.0, "seconds an answer may go silent mid-way before its replica counts as failed (and the answer is "
        "continued elsewhere)", commands=(SERVE, ROUTE))
    max_pending: int = opt(  # requests in the router (waiting + in flight); past it: 429
        1024, "requests the router holds before answering 429", commands=(SERVE, ROUTE))
    queue_timeout: float = opt(  # longest wait for a routable replica; then 503
        30.0, "longest wait for a routable replica before 503", commands=(SERVE, ROUTE))
    connect_timeout: float = 5.0
    request_timeout: float = 600.0  # longest silence from a replica during one request
    retry_after: int = 1
    max_body_bytes: int = opt(
        MAX_BODY_BYTES, "largest request body in bytes the router forwards (413 past it); images sent inline count "
        "in it", commands=(ROUTE,), metavar="BYTES")
    # The console (/ui): its JSON API needs this key when set (the replicas check their own on the
    # API); and where tripod bench wrote its runs, for the benchmark history.
    api_key: str | None = opt(
        None, "require this key on the console's JSON API (/ui/api/*); the replicas check their own on the API "
        "(default: $TRIPOD_API_KEY)", commands=(ROUTE,), env="TRIPOD_API_KEY")
    bench_dir: str | None = opt(None, BENCH_DIR_HELP, commands=(ROUTE,), metavar="DIR", group="console")
    # Regions (router/policy.py prefer_region) and the router's tenant fair share (router/fairness.py).
    region: str = opt("", "this router's region: replicas labelled with it are preferred (--replica URL,region=NAME)",
                      commands=(SERVE, ROUTE), metavar="NAME")
    region_overflow_load: float = opt(
        8.0, "requests in flight on each routable replica of this router's region past which requests overflow to "
        "other regions", commands=(SERVE, ROUTE), metavar="N")
    replica_max_inflight: int = opt(
        0, "requests in flight per routable replica before the router queues by tenant fair share (0: no "
        "router queue)", commands=(SERVE, ROUTE), metavar="N")

    # Tenants, audit log and TLS (tripod.tenants; docs/tenants.md); a fleet's router reads the server's options.
    tenants: str | None = opt(None, "a TOML file of tenants: the router checks keys and enforces every limit "
                              "across its replicas (token limits and max_context with a replica's count of the "
                              "request; give the replicas the same file and --tenant-limits none)", commands=(ROUTE,), metavar="FILE", group="tenants")
    audit_log: str | None = opt(None, "one JSON line per authenticated request (rotated by size)", commands=(ROUTE,),
                                metavar="FILE", group="tenants")
    audit_log_content: bool = opt(False, "put the prompt's text in the audit log", commands=(ROUTE,), group="tenants")
    audit_log_max_bytes: int = 64 * 2**20
    ssl_certfile: str | None = opt(None, "serve HTTPS with this PEM certificate", commands=(ROUTE,), metavar="FILE",
                                   group="tenants")
    ssl_keyfile: str | None = opt(None, "its PEM private key", commands=(ROUTE,), metavar="FILE", group="tenants")
    ssl_ca: str | None = opt(None, "CA bundle (PEM) to verify https:// replicas with (instead of the system's)",
                             commands=(ROUTE,), metavar="FILE", group="tenants")
    otel_endpoint: str | None = opt(None, OTEL_ENDPOINT_HELP, commands=(ROUTE,), metavar="URL", group="tracing")
    otel_file: str | None = opt(None, OTEL_FILE_HELP, commands=(ROUTE,), metavar="FILE", group="tracing")

    def __post_init__(self) -> None:
        if self.region_overflow_load <= 0 or self.replica_max_inflight < 0:
            raise ValueError("region_overflow_load must be > 0 and replica_max_inflight >= 0")
        if self.policy not in ROUTING_POLICIES:
            raise ValueError(f"policy must be one of {', '.join(ROUTING_POLICIES)} (got {self.policy!r})")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535] (got {self.port})")
        for name in ("load_weight", "chars_per_token", "balance_rel"):
            if getattr(self, name) < 0 or (name != "load_weight" and getattr(self, name) == 0):
                raise ValueError(f"{name} must be > 0 (got {getattr(self, name)})")
        for name in ("health_interval", "health_timeout", "metrics_interval", "queue_timeout",
                     "connect_timeout", "request_timeout", "stall_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0 (got {getattr(self, name)})")
        if self.failure_threshold < 1 or self.max_pending < 1 or self.max_retries < 0 or self.balance_abs < 0:
            raise ValueError("failure_threshold and max_pending must be >= 1; max_retries and balance_abs >= 0")
        check_tls(self.ssl_certfile, self.ssl_keyfile)


@dataclass(frozen=True, slots=True)
class FleetConfig:
    """``tripod serve --replicas N`` / ``--min-replicas --max-replicas``: the supervisor and autoscaler."""

    min_replicas: int = 1
    max_replicas: int = 1
    # Prefill/decode disaggregation: this many more replicas run --role prefill (the others --role
    # decode); the router hands new prompts' prefill to them.
    prefill_replicas: int = 0
    backend: str = opt("local", "where replicas run: local processes or Ray actors", commands=(SERVE, CHAINS_SERVE), choices=("local", "ray"))
    ray_address: str | None = opt(  # None: a local Ray instance; "auto": the running cluster
        None, "ray: 'auto' joins the running cluster (default: a local one)", commands=(SERVE, CHAINS_SERVE))
    ray_num_cpus: float = opt(  # resources each replica actor asks Ray for
        1.0, "ray: CPUs each model replica reserves", commands=(SERVE, CHAINS_SERVE))
    ray_num_gpus: float = opt(0.0, "ray: GPUs each model replica reserves", commands=(SERVE, CHAINS_SERVE))
    start_timeout: float = opt(  # a replica not healthy by then is restarted
        300.0, "seconds every replica gets to become healthy", commands=(CHAINS_SERVE,))
    restart_backoff: float = 1.0  # first restart delay; doubles per crash, up to restart_backoff_max
    restart_backoff_max: float = 30.0
    # Autoscaler: desired replicas = ceil(mean over `lookback` s of (in-flight + queued requests)
    # / target); acted on once the wish has held for upscale_delay / downscale_delay seconds.
    target_inflight: float = opt(
        8.0, "autoscaler: requests in flight (+ queued) per replica it aims for", commands=(SERVE,))
    lookback: float = opt(30.0, "seconds of load the autoscaler averages", commands=(SERVE,))
    upscale_delay: float = opt(10.0, "seconds a wish to grow must hold", commands=(SERVE,))
    downscale_delay: float = opt(60.0, "seconds a wish to shrink must hold", commands=(SERVE,))
    autoscale_interval: float = 1.0
    drain_timeout: float = 60.0  # scale-down: longest wait for a replica's in-flight requests
    # SLO autoscaling and scale to zero (min_replicas 0): fleet/slo.py says how these are used.
    slo_ttft_p95: float | None = opt(
        None, "autoscaler: p95 time to first token to keep, in ms (scales on measured latency)", commands=(SERVE,),
        metavar="MS")
    slo_tpot_p95: float | None = opt(
        None, "autoscaler: p95 time per output token to keep, in ms", commands=(SERVE,), metavar="MS")
    slo_headroom: float = 0.5  # shrink only while every p95 is under this fraction of its SLO
    scale_cooldown: float = 15.0  # seconds after any scaling before the next decision

    def __post_init__(self) -> None:
        if self.min_replicas < 0 or self.max_replicas < max(self.min_replicas, 1):
            raise ValueError(f"need 0 <= min_replicas <= max_replicas, max_replicas >= 1 (got {self.min_replicas}, "
                             f"{self.max_replicas})")
        if self.prefill_replicas < 0:
            raise ValueError(f"prefill_replicas must be >= 0 (got {self.prefill_replicas})")
        if self.prefill_replicas and (self.autoscaling or self.min_replicas < 1):
            raise ValueError("--prefill-replicas runs a fixed fleet: give --replicas N (the decode replicas), not "
                             "--min-replicas/--max-replicas (autoscaling a disaggregated fleet is not built)")
        if any(v is not None and v <= 0 for v in (self.slo_ttft_p95, self.slo_tpot_p95)):
            raise ValueError(f"slo_ttft_p95 and slo_tpot_p95 must be > 0 ms (got {self.slo_ttft_p95}, {self.slo_tpot_p95})")
        if not 0 < self.slo_headroom < 1 or self.scale_cooldown < 0:
            raise ValueError("slo_headroom must be in (0, 1) and scale_cooldown >= 0")
        if self.backend not in ("local", "ray"):
            raise ValueError(f"backend must be 'local' or 'ray' (got {self.backend!r})")
        if self.target_inflight <= 0:
            raise ValueError(f"target_inflight must be > 0 (got {self.target_inflight})")
        for name in ("start_timeout", "restart_backoff", "restart_backoff_max", "lookback", "autoscale_interval",
                     "drain_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0 (got {getattr(self, name)})")
        if self.upscale_delay < 0 or self.downscale_delay < 0:
            raise ValueError("upscale_delay and downscale_delay must be >= 0")

    @property
    def autoscaling(self) -> bool:
        return self.max_replicas > self.min_replicas

    @property
    def slo(self) -> bool:
        return self.slo_ttft_p95 is not None or self.slo_tpot_p95 is not None
