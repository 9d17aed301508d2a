"""Typed, frozen configuration. Validated on construction; errors say what to change.

Each field a user may set on the command line is declared with ``opt(...)``: its help, flag,
choices and the commands that take it (``tripod.config_cli.Opt``). The command line is built from
these declarations, reads the configs back from them and writes a config as the argv a fleet's
replica receives, so that no option is declared twice.

NOTE: torch-free at import (torch is imported where a method needs it): the command line imports
this module to build its parsers, and ``tripod route``/``tripod bench`` never load torch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tripod.config_cli import opt
from tripod.kernels.build import LEVELS

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

# The ISA levels of tripod's CPU kernels, best first: a level as --kernels forces it (tests,
# comparisons); "optimized" takes the best this CPU supports.
KERNEL_LEVELS = LEVELS
KERNEL_MODES = ("auto", "eager", "optimized", *KERNEL_LEVELS)
WEIGHT_MODES = ("dequantized", "stored", "fp8")
_DTYPES = ("float32", "bfloat16", "float16")  # names of torch dtypes
_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16", "float": "float32"}


# The commands an option can belong to (Opt.commands).
GENERATE, CHAT, SERVE, ROUTE, CHAINS_SERVE = "generate", "chat", "serve", "route", "chains serve"
ENGINE_COMMANDS = (GENERATE, CHAT, SERVE)
BENCH_DIR_HELP = ("where tripod bench wrote its runs (a --out folder, or a folder of them): the console's "
                  "Benchmarks view and history")


@dataclass(frozen=True, slots=True)
class SpeculativeSpec:
    """A parsed ``--speculative`` value: ``kind`` is ngram | draft | self | mtp; ``path`` the draft
    checkpoint (None: the embedded model); ``layers`` the self-speculative draft's depth."""

    kind: str
    path: str | None = None
    layers: int = 0


def parse_speculative(value: str) -> SpeculativeSpec:
    """``ngram`` | ``draft:PATH`` (``draft:embedded``: the embedded model) | ``self:K`` | ``mtp``."""
    kind, _, arg = value.partition(":")
    if kind in ("ngram", "mtp") and not arg:
        return SpeculativeSpec(kind)
    if kind == "draft" and arg:
        return SpeculativeSpec("draft", None if arg == "embedded" else arg)
    if kind == "self" and arg.isdigit() and int(arg) >= 1:
        return SpeculativeSpec("self", layers=int(arg))
    raise ValueError(
        f"speculative must be 'ngram', 'draft:PATH' (a checkpoint with the same tokenizer, or "
        f"'draft:embedded'), 'self:K' (the model's first K layers as its own draft) or 'mtp' (the "
        f"checkpoint's multi-token-prediction module, DeepSeek-V3); got {value!r}"
    )


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything that shapes one engine: the model, numerics, memory and scheduling."""

    model: str | None = opt(  # None: the embedded SmolLM2; else a .gguf file or an HF folder
        None, "a .gguf file or a local HF folder (default: embedded SmolLM2-135M-Instruct)", commands=ENGINE_COMMANDS)
    dtype: str = opt(  # auto | float32 | bfloat16 | float16 (CUDA only)
        "auto", "auto | float32 | bfloat16 | float16 (CUDA only); auto = bfloat16 where native",
        commands=ENGINE_COMMANDS)
    device: str = opt("cpu", "cpu | cuda | cuda:N", commands=ENGINE_COMMANDS)
    kv_cache_tokens: int | None = opt(  # None: kv_mem_fraction of free memory
        None, "KV budget in tokens (default: a fraction of free memory)", commands=ENGINE_COMMANDS)
    kv_mem_fraction: float = 0.1
    max_kv_cache_tokens: int = 131072  # cap on the fraction-derived budget
    max_model_len: int | None = opt(None, "context limit (default: the model's)", commands=ENGINE_COMMANDS)
    max_running: int = opt(128, "requests decoding at once", commands=ENGINE_COMMANDS)
    max_batch_tokens: int = opt(  # decodes + prefill chunks
        512, "tokens per forward pass", commands=ENGINE_COMMANDS)
    chunk_size: int = opt(256, "longest prefill chunk per step", commands=ENGINE_COMMANDS)
    policy: str = opt("lpm", "waiting-queue order", commands=ENGINE_COMMANDS, choices=("lpm", "fcfs"))
    aging: float = 8.0  # lpm: tokens of credit per step waited
    enable_prefix_cache: bool = opt(
        True, "disable the radix prefix cache", commands=ENGINE_COMMANDS, flag="--no-prefix-cache")
    decode_mirror: bool = True  # dense copy of decoding requests' KV (see engine/decode_mirror.py)
    seed: int = 0  # for sampled requests without a seed
    # CPU: torch intra-op threads (None: torch's default; a local fleet gives each replica its share).
    num_threads: int | None = opt(None, "CPU threads for torch", commands=ENGINE_COMMANDS, flag="--threads")
    # The compute path. "auto": float32 runs the reference path (op for op with Hugging Face),
    # 16-bit dtypes the optimized one. "eager": the reference path always. "optimized": packed
    # matmuls and tripod's CPU kernels of the best ISA level this CPU supports (built in the
    # background under "auto", and serving on torch's ops until they are ready; waited for
    # under "optimized"), in float32 too. A level ("avx2", "avx512", "avx512_bf16"): "optimized"
    # on that level's kernels (every level computes the same bits; for tests and comparisons).
    kernels: str = opt(
        "auto", "compute path: auto = optimized for 16-bit dtypes (tripod's CPU kernels of the best ISA level "
        "this CPU supports, built in the background on first use), the float32 reference path for float32; "
        "eager = the reference path; optimized = tripod's kernels in any dtype; avx2 / avx512 / avx512_bf16 = "
        "optimized on that level (every level computes the same bits)",
        commands=ENGINE_COMMANDS, choices=KERNEL_MODES)
    # "dequantized": every weight dequantized to the run dtype. "stored": a GGUF's Q4_1/Q8_0/Q5_0/Q4_K/Q6_K
    # weights executed as stored by tripod's kernels (a quarter/half of bf16's bytes per token,
    # exactly the dequantized weights, float32 compute). "fp8": a block-wise FP8 checkpoint's
    # weights kept in FP8, dequantized band by band inside each matmul (w8a16, the run dtype's
    # activations). Explicit, logged, shown in /v1/models.
    weights: str = opt(
        "dequantized", "stored: execute a GGUF's Q4_1/Q8_0/Q5_0/Q4_K/Q6_K weights as stored (a quarter/half of "
        "bf16's bytes per token, exactly the dequantized weights, float32 compute); fp8: keep a block-wise FP8 "
        "checkpoint's weights in FP8 (w8a16)",
        commands=ENGINE_COMMANDS, choices=WEIGHT_MODES)
    # Structured outputs: verify grammar-forced text in one forward pass (lossless; see engine).
    jump_forward: bool = opt(
        True, "structured outputs: decode grammar-forced text token by token (outputs are identical either way)",
        commands=ENGINE_COMMANDS, flag="--no-jump-forward")
    max_jump_forward: int = 32  # draft tokens per verification
    # Speculative decoding (engine/speculative): None (off), "ngram" (prompt lookup), "draft:PATH"
    # (a smaller model with the same tokenizer; "draft:embedded" = the embedded model) or "self:K"
    # (this model's first K layers and its head: a self-speculative draft sharing weights and KV).
    # Lossless: outputs are those of plain decoding. Per request: SamplingParams.speculative.
    # NOTE: checked at parse time too, so a fleet refuses a bad method before it launches a replica.
    speculative: str | None = opt(
        None, "speculative decoding (lossless: outputs are those of plain decoding): ngram (prompt lookup) | "
        "draft:PATH (a smaller model with the same tokenizer; draft:embedded) | self:K (this model's first K "
        "layers as its draft), mtp (the checkpoint's multi-token-prediction module: DeepSeek-V3); a request "
        "opts out with \"speculative\": false",
        commands=ENGINE_COMMANDS, metavar="METHOD", check=parse_speculative)
    num_draft_tokens: int = opt(  # most draft tokens per request per step
        4, "speculative: most draft tokens per request per step (1-64)", commands=ENGINE_COMMANDS, metavar="K")
    # Speculate only while at most this many requests decode in a step (the measured break-even
    # batch on 2 CPU cores; docs/architecture.md): a big batch has no compute to spare.
    spec_max_batch: int = opt(
        8, "speculative: speculate only while at most B requests decode in a step (0: never)",
        commands=ENGINE_COMMANDS, metavar="B")
    # Draft lengths from a measured cost model (speculate only where it pays); False: always the
    # full num_draft_tokens (for measuring a proposer's acceptance).
    spec_adaptive: bool = True
    # One model over several processes (engine/parallel.py): T ranks, each a shard of every
    # layer (heads, MLP columns, a vocabulary slice) and its own KV pool.
    tensor_parallel_size: int = opt(
        1, "tensor parallel: run the model as T processes (this one and T-1 workers), each holding 1/T of every "
        "layer (attention heads, MLP columns or experts, the vocabulary) and its own KV pool; collectives over "
        "torch.distributed (gloo on CPU, NCCL on CUDA)", commands=ENGINE_COMMANDS, metavar="T")
    pipeline_parallel_size: int = opt(
        1, "pipeline parallel: run the model as P processes, each holding a contiguous 1/P of its layers and their "
        "KV (this process the first, which samples); hidden states pass stage to stage", commands=ENGINE_COMMANDS,
        metavar="P")
    enable_expert_parallel: bool = opt(
        False, "with --tensor-parallel-size: split a MoE's experts over the ranks (each rank whole experts; the "
        "shared expert replicated) instead of splitting every expert's columns", commands=ENGINE_COMMANDS)
    parallel_timeout: float = opt(
        60.0, "tensor parallel: seconds a collective may wait for a rank before the group is declared failed",
        commands=ENGINE_COMMANDS, metavar="S")

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", *_DTYPES, *_ALIASES):
            raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)} (got {self.dtype!r})")
        if not (self.device == "cpu" or self.device == "cuda" or self.device.startswith("cuda:")):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N' (got {self.device!r})")
        for name in ("max_running", "max_batch_tokens", "chunk_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 (got {getattr(self, name)})")
        if self.max_batch_tokens < self.max_running:
            raise ValueError(
                f"max_batch_tokens ({self.max_batch_tokens}) must be >= max_running "
                f"({self.max_running}) so every running request can decode each step"
            )
        if self.kernels not in KERNEL_MODES:
            raise ValueError(f"kernels must be one of {', '.join(KERNEL_MODES)} (got {self.kernels!r})")
        if self.weights not in WEIGHT_MODES:
            raise ValueError(f"weights must be one of {', '.join(WEIGHT_MODES)} (got {self.weights!r})")
        if self.weights == "stored":
            if self.kernels == "eager":
                raise ValueError("--weights stored runs on tripod's kernels; it cannot be combined with --kernels eager")
            if _ALIASES.get(self.dtype, self.dtype) not in ("auto", "float32"):
                raise ValueError(
                    "--weights stored computes in float32 with exactly the dequantized weights; "
                    f"use --dtype auto or float32 (got {self.dtype!r})"
                )
        if self.speculative is not None:
            parse_speculative(self.speculative)  # raises with what to change
        if not 1 <= self.num_draft_tokens <= 64:
            raise ValueError(f"num_draft_tokens must be in [1, 64] (got {self.num_draft_tokens})")
        if self.spec_max_batch < 0:
            raise ValueError(f"spec_max_batch must be >= 0 (got {self.spec_max_batch})")
        if self.policy not in ("lpm", "fcfs"):
            raise ValueError(f"policy must be 'lpm' or 'fcfs' (got {self.policy!r})")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2 (got {self.max_model_len})")
        self._check_parallel()

    def _check_parallel(self) -> None:
        if self.tensor_parallel_size < 1 or self.pipeline_parallel_size < 1:
            raise ValueError("tensor_parallel_size and pipeline_parallel_size must be >= 1 "
                             f"(got {self.tensor_parallel_size}, {self.pipeline_parallel_size})")
        if self.parallel_timeout <= 0:
            raise ValueError(f"parallel_timeout must be > 0 (got {self.parallel_timeout})")

    def check_parallel(self) -> None:
        """What a model over several processes cannot combine with (yet); checked when an engine
        is built, so that a config naming both still round-trips through the command line."""
        if self.tensor_parallel_size > 1 and self.pipeline_parallel_size > 1:
            raise ValueError("combining --tensor-parallel-size and --pipeline-parallel-size is not built yet: give one")
        if self.enable_expert_parallel and self.tensor_parallel_size == 1:
            raise ValueError("--enable-expert-parallel splits experts over the tensor-parallel ranks: "
                             "give --tensor-parallel-size 2 or more")
        if self.world_size == 1:
            return
        if self.weights != "dequantized":
            raise ValueError(f"a model over several processes runs dequantized weights for now (got --weights {self.weights})")
        if self.speculative is not None and parse_speculative(self.speculative).kind != "ngram":
            raise ValueError("a model over several processes supports --speculative ngram only for now (a draft "
                             f"model would run unsharded on rank 0; got {self.speculative!r})")

    @property
    def world_size(self) -> int:
        """How many processes run the model (tensor x pipeline parallel)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def compute_path(self, dtype: torch.dtype) -> str:
        """"eager" (the reference path) or "optimized", for this config's ``kernels`` mode."""
        if self.weights == "stored":
            return "optimized"
        if self.kernels == "auto":
            import torch

            return "eager" if dtype == torch.float32 else "optimized"
        return "eager" if self.kernels == "eager" else "optimized"

    @property
    def kernel_level(self) -> str | None:
        """The ISA level ``--kernels`` forces (None: the best this CPU supports)."""
        return self.kernels if self.kernels in KERNEL_LEVELS else None

    def torch_device(self) -> torch.device:
        import torch

        dev = torch.device(self.device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device 'cuda' was asked for but no CUDA device is available")
        return dev

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        name = _ALIASES.get(self.dtype, self.dtype)
        if name == "auto" and self.weights == "stored":
            name = "float32"
        if name == "auto":
            name = "bfloat16" if fast_bf16(device) else "float32"
        if name == "float16" and device.type != "cuda":
            raise ValueError("float16 is only supported on CUDA; use bfloat16 or float32 on the CPU")
        import torch

        dtype: torch.dtype = getattr(torch, name)
        return dtype


def fast_bf16(device: torch.device) -> bool:
    """Whether bfloat16 is the fastest exact-enough default here: CUDA with bf16, a CPU with
    native bf16 (AVX512-BF16 or AMX), or any CPU that runs tripod's kernels (AVX2 and up: bf16
    weights, float32 FMA, half of float32's bytes per token; benchmarks/results/isa_levels.md)."""
    if native_bf16(device):
        return True
    if device.type != "cpu":
        return False
    from tripod import kernels

    return kernels.unavailable_reason() is None


def native_bf16(device: torch.device) -> bool:
    """Whether the hardware computes bfloat16 natively (CUDA; CPUs with AVX512-BF16 or AMX)."""
    if device.type == "cuda":
        import torch

        return bool(torch.cuda.is_bf16_supported())
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool({"avx512_bf16", "amx_bf16"} & flags)
    except OSError:
        pass
    return False


def check_tls(certfile: str | None, keyfile: str | None) -> None:
    """HTTPS needs both the certificate and its key."""
    if (certfile is None) != (keyfile is None):
        raise ValueError("--ssl-certfile and --ssl-keyfile go together: give both for HTTPS, or neither")


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """The HTTP side of ``tripod serve``: where it listens, who may call it, how it sheds load."""

    host: str = opt("127.0.0.1", "address to listen on (default: loopback only)", commands=(SERVE, CHAINS_SERVE),
                    forward=False)
    port: int = opt(8000, commands=(SERVE, CHAINS_SERVE), forward=False)
    api_key: str | None = opt(  # when set, /v1/* (and /tokenize, /detokenize) need a Bearer key
        None, "require 'Authorization: Bearer KEY' on /v1/* (default: $TRIPOD_API_KEY)", commands=(SERVE,),
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
    max_body_bytes: int = 4 * 2**20
    max_n: int = opt(16, "largest 'n' a request may ask for", commands=(SERVE,))
    heartbeat_interval: float = 0.5  # engine → server
    heartbeat_timeout: float = 30.0  # no heartbeat this long: the engine is hung
    engine_start_timeout: float = 600.0
    # After the engine dies: seconds to keep answering 503 (so health checkers see it) before exit.
    dead_grace: float = 2.0
    bench_dir: str | None = opt(  # the console's benchmark history: where tripod bench wrote its runs
        None, BENCH_DIR_HELP, commands=(SERVE,), metavar="DIR", group="console", forward=False)

    # Tenants, audit log and TLS (tripod.tenants; README "Tenants"); audit/TLS are not forwarded to replicas.
    tenants: str | None = opt(None, "a TOML file of tenants: keys, weights, limits (reloaded on SIGHUP and on change)",
                              commands=(SERVE,), metavar="FILE", group="tenants")
    tenant_limits: str = opt("all", "tenant limits enforced here: all; tokens (token limits and max_context only: a "
                             "fleet's replicas); none", commands=(SERVE,), choices=("all", "tokens", "none"), group="tenants")
    audit_log: str | None = opt(None, "one JSON line per authenticated request (rotated by size)", commands=(SERVE,),
                                metavar="FILE", group="tenants", forward=False)
    audit_log_content: bool = opt(False, "put the prompt's text in the audit log", commands=(SERVE,), group="tenants",
                                  forward=False)
    audit_log_max_bytes: int = 64 * 2**20  # rotated past this size, 5 old files kept
    ssl_certfile: str | None = opt(None, "serve HTTPS with this PEM certificate", commands=(SERVE,), metavar="FILE",
                                   group="tenants", forward=False)
    ssl_keyfile: str | None = opt(None, "its PEM private key", commands=(SERVE,), metavar="FILE", group="tenants",
                                  forward=False)

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


ROUTING_POLICIES = ("cache_aware", "least_load", "round_robin")


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """``tripod route``: how the router picks a replica, watches replicas and sheds load."""

    # In `tripod serve` (a fleet) the router listens where the server would: --host/--port are
    # ServerConfig's options there, as are --api-key and --bench-dir (see config_cli.from_namespace).
    host: str = opt("127.0.0.1", "address to listen on (default: loopback only)", commands=(ROUTE,))
    port: int = opt(8000, commands=(ROUTE,))
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
    max_body_bytes: int = 4 * 2**20
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

    # Tenants, audit log and TLS (tripod.tenants; README "Tenants"); a fleet's router reads the server's options.
    tenants: str | None = opt(None, "a TOML file of tenants: the router checks keys and enforces requests_per_second, "
                              "max_concurrent, models", commands=(ROUTE,), metavar="FILE", group="tenants")
    audit_log: str | None = opt(None, "one JSON line per authenticated request (rotated by size)", commands=(ROUTE,),
                                metavar="FILE", group="tenants")
    audit_log_content: bool = opt(False, "put the prompt's text in the audit log", commands=(ROUTE,), group="tenants")
    audit_log_max_bytes: int = 64 * 2**20
    ssl_certfile: str | None = opt(None, "serve HTTPS with this PEM certificate", commands=(ROUTE,), metavar="FILE",
                                   group="tenants")
    ssl_keyfile: str | None = opt(None, "its PEM private key", commands=(ROUTE,), metavar="FILE", group="tenants")
    ssl_ca: str | None = opt(None, "CA bundle (PEM) to verify https:// replicas with (instead of the system's)",
                             commands=(ROUTE,), metavar="FILE", group="tenants")

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


@dataclass(frozen=True, slots=True)
class SamplingOptions:
    """The sampling options of ``tripod generate``/``tripod chat``: an interactive session's
    defaults (greedy, up to 256 tokens), validated where they land (``SamplingParams`` in process,
    the server's request checks with ``--url``)."""

    max_tokens: int = opt(256, commands=(GENERATE, CHAT))
    temperature: float = opt(0.0, "0 = greedy (default)", commands=(GENERATE, CHAT))
    top_p: float = opt(1.0, commands=(GENERATE, CHAT))
    top_k: int = opt(-1, commands=(GENERATE, CHAT))
    min_p: float = opt(0.0, commands=(GENERATE, CHAT))
    repetition_penalty: float = opt(1.0, commands=(GENERATE, CHAT))
    seed: int | None = opt(None, commands=(GENERATE, CHAT))
    ignore_eos: bool = opt(False, commands=(GENERATE, CHAT))
