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
from tripod.config_commands import (
    BENCH_DIR_HELP,
    CHAINS_SERVE,
    CHAT,
    ENGINE_COMMANDS,
    GENERATE,
    ROUTE,
    SERVE,
)
from tripod.kernels.build import LEVELS, OPT_IN_LEVELS

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

# The ISA levels of tripod's CPU kernels, best first: a level as --kernels forces it (tests,
# comparisons); "optimized" takes the best this CPU supports.
KERNEL_LEVELS = (*LEVELS, *OPT_IN_LEVELS)
KERNEL_MODES = ("auto", "eager", "optimized", "triton", *KERNEL_LEVELS)
WEIGHT_MODES = ("auto", "dequantized", "stored", "fp8")
_DTYPES = ("float32", "bfloat16", "float16")  # names of torch dtypes
TASKS = ("generate", "embed")  # what a server of a decoder answers (--task)
_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16", "float": "float32"}



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


def parse_loras(value: str) -> dict[str, str]:
    """``NAME=PATH[,NAME=PATH...]`` → {name: path} (names distinct, neither part empty)."""
    out: dict[str, str] = {}
    for part in value.split(","):
        name, sep, path = part.strip().partition("=")
        name, path = name.strip(), path.strip()
        if not sep or not name or not path:
            raise ValueError(f"--lora takes NAME=PATH[,NAME=PATH...] (got {part.strip()!r})")
        if name in out:
            raise ValueError(f"--lora names {name!r} twice")
        out[name] = path
    return out


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
    # The disk tier under the prefix cache (memory/tiered_cache.py, memory/disk_tier.py): evicted
    # prefixes are written to DIR and loaded back instead of recomputed; a restart, or another
    # engine of the same model on DIR, finds them there.
    kv_disk: str | None = opt(
        None, "a directory for the prefix cache's disk tier: evicted prefixes are written there and loaded back "
        "instead of recomputed; kept across restarts and shared by the engines (replicas) of the same model and "
        "dtype pointed at it", commands=ENGINE_COMMANDS, metavar="DIR")
    kv_disk_size: float = opt(
        16.0, "--kv-disk: the tier's capacity in GB (least recently used blocks are removed beyond it)",
        commands=ENGINE_COMMANDS, metavar="GB")
    # Hybrid (linear-attention) models: recurrent-state slots (memory/state_pool.py); None: one
    # per --max-running request (fewer makes admissions wait for a slot).
    max_state_slots: int | None = opt(
        None, "hybrid (linear-attention / state-space) models: how many sequences' recurrent state (every linear "
        "layer's conv window + state, float32) the state pool holds, i.e. how many of them run at once (default: "
        "one per --max-running request; ignored by other models)", commands=ENGINE_COMMANDS, metavar="N")
    # ... and state snapshots on prefix-cache nodes (memory/state_snapshots.py; 0: hybrids get no
    # prefix-cache hits); None: as many as state slots.
    max_state_snapshots: int | None = opt(
        None, "hybrid models: how many recurrent-state snapshots the prefix cache keeps on its nodes (a hit resumes "
        "from one; least recently used evicted first; 0 = no prefix-cache hits for hybrids; default: as many as "
        "state slots; ignored by other models)", commands=ENGINE_COMMANDS, metavar="N")
    decode_mirror: bool = True  # dense copy of decoding requests' KV (see memory/decode_mirror.py)
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
        "optimized on that level (every level computes the same bits); triton = the Triton kernels (what "
        "--device cuda runs under auto/optimized; on the CPU only in Triton's interpreter, TRITON_INTERPRET=1)",
        commands=ENGINE_COMMANDS, choices=KERNEL_MODES)
    # CUDA graphs for decode steps (the Triton backend on a GPU): one graph per batch-size bucket
    # up to this many rows; larger decode steps, prefill and mixed steps run eagerly.
    cuda_graphs: bool = opt(True, "decode steps eagerly, without CUDA graphs", commands=ENGINE_COMMANDS,
                            flag="--no-cuda-graphs")
    cuda_graph_max_bs: int = opt(256, "largest decode batch captured in a CUDA graph", commands=ENGINE_COMMANDS)
    # The overlap scheduler (engine/overlap.py): a decode step laid out while the previous one
    # computes, adopted only when the scheduler's decision is certain to be the same (outputs
    # unchanged). auto: on for the Triton backend on CUDA, where launches return at once.
    overlap_schedule: str = opt("auto", "lay decode steps out during the previous forward: auto (on for "
                                "CUDA) | on | off", commands=ENGINE_COMMANDS, choices=("auto", "on", "off"))
    # CUDA: the KV pool takes this fraction of the GPU's memory, less what the weights (and the
    # activations' reserve) already hold; --kv-cache-tokens overrides it.
    gpu_memory_utilization: float = opt(0.9, "fraction of GPU memory for weights + KV pool (CUDA)",
                                        commands=ENGINE_COMMANDS)
    # "auto" (default): "stored" for a quantized GGUF, or an AWQ / GPTQ / compressed-tensors folder
    # (docs/quantized.md), where the kernels run it (CPU, one process, --dtype auto), else
    # "dequantized" (loader/weights_mode.py; resolved before the engine is built).
    # "dequantized": every weight dequantized to the run dtype. "stored": a GGUF's Q4_0/Q4_1/Q8_0/Q5_0/Q4_K/Q6_K
    # weights executed as stored by tripod's kernels (Q4_0 18 and Q4_1 20 bytes per 32 weights: ~0.28-0.31
    # of bf16's 64; Q8_0 and Q5_0 34: ~0.53; Q4_K 24: ~0.38; Q6_K 40: ~0.63 (kernels/csrc/linear.cpp),
    # exactly the dequantized weights; the run dtype's activations: bfloat16 under --dtype auto,
    # each product of a bf16 activation and a code exact, or float32). "fp8": a block-wise FP8 checkpoint's
    # weights kept in FP8: w8a8 through torch._scaled_mm on FP8 tensor cores (sm_89+), else dequantized
    # band by band inside each matmul (w8a16, the run dtype's activations; layers/fp8.py). Explicit, logged, shown in /v1/models.
    weights: str = opt(
        "auto", "auto (default): stored for a quantized GGUF or an AWQ/GPTQ/compressed-tensors folder on the CPU "
        "with --dtype auto, else dequantized; "
        "stored: execute a GGUF's Q4_0/Q4_1/Q8_0/Q5_0/Q4_K/Q6_K weights (or an AWQ/GPTQ/compressed-tensors "
        "folder's int4 / symmetric int8 codes) as stored (about 0.3 of bf16's bytes per token for Q4_0/Q4_1, "
        "0.53 for Q8_0, exactly the dequantized weights; activations in the run dtype: bfloat16 under "
        "--dtype auto, float32 with --dtype float32); fp8: keep a block-wise FP8 "
        "checkpoint's weights in FP8 (w8a8 on FP8 tensor cores, sm_89+; elsewhere w8a16, dequantized band by "
        "band; the log says which)",
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
        "layers as its draft) | mtp (the checkpoint's multi-token-prediction module: DeepSeek-V3, V3.2, V4); a request "
        "opts out with \"speculative\": false",
        commands=ENGINE_COMMANDS, metavar="METHOD", check=parse_speculative)
    num_draft_tokens: int = opt(  # most draft tokens per request per step
        4, "speculative: most draft tokens per request per step (1-64)", commands=ENGINE_COMMANDS, metavar="K")
    # Speculate only while at most this many requests decode in a step (the measured break-even
    # batch on 2 CPU cores; docs/performance.md): a big batch has no compute to spare.
    spec_max_batch: int = opt(
        8, "speculative: speculate only while at most B requests decode in a step (0: never)",
        commands=ENGINE_COMMANDS, metavar="B")
    # Draft lengths from a measured cost model (speculate only where it pays); False: always the
    # full num_draft_tokens (for measuring a proposer's acceptance).
    spec_adaptive: bool = True
    # One model over several processes (engine/executor/): T ranks, each a shard of every
    # layer (heads, MLP columns, a vocabulary slice) and its own KV pool.
    tensor_parallel_size: int = opt(
        1, "tensor parallel: run the model as T processes (this one and T-1 workers), each holding 1/T of every "
        "layer (attention heads, MLP columns or experts, the vocabulary) and its own KV pool; collectives over "
        "torch.distributed (gloo on CPU, NCCL on CUDA)", commands=ENGINE_COMMANDS, metavar="T")
    pipeline_parallel_size: int = opt(
        1, "pipeline parallel: run the model as P processes, each holding a contiguous 1/P of its layers and their "
        "KV (this process the first, which samples); hidden states pass stage to stage", commands=ENGINE_COMMANDS,
        metavar="P")
    data_parallel_size: int = opt(
        1, "data-parallel attention for MLA models (DeepSeek-V2/V3): run the model as D processes, each holding "
        "the latent KV cache of its own requests and running their attention (full heads), while the MoE/MLP "
        "layers, the embedding and the head are split over all D ranks (tokens gathered for them); other "
        "models: use --tensor-parallel-size or --replicas", commands=ENGINE_COMMANDS, metavar="D")
    enable_expert_parallel: bool = opt(
        False, "with --tensor-parallel-size (or --data-parallel-size): split a MoE's experts over the ranks (each rank whole experts; the "
        "shared expert replicated) instead of splitting every expert's columns", commands=ENGINE_COMMANDS)
    parallel_backend: str = opt(
        "local", "where ranks 1.. of a model over several processes run: processes spawned here (local), or Ray "
        "actors in a placement group, one bundle per rank, on the nodes of a Ray cluster (ray)",
        commands=ENGINE_COMMANDS, choices=("local", "ray"))
    parallel_placement: str = opt(
        "pack", "--parallel-backend ray: how the ranks' bundles are placed: pack (as few nodes as possible), "
        "spread (over as many as possible), strict-pack (one node), strict-spread (one rank per node)",
        commands=ENGINE_COMMANDS, choices=("pack", "spread", "strict-pack", "strict-spread"))
    parallel_ray_address: str | None = opt(
        None, "--parallel-backend ray: the cluster to join ('auto': this machine's, started with `ray start`; "
        "ray://host:10001; default: a Ray instance of this process)", commands=ENGINE_COMMANDS, metavar="ADDRESS")
    # LoRA adapters (engine/lora.py): served beside the base model, a request picks one by name.
    lora: str | None = opt(
        None, "LoRA adapters to serve beside the base model: NAME=PATH ... (PEFT folders: adapter_config.json + "
        "adapter_model.safetensors; several after one --lora, several --lora, or NAME=PATH,NAME=PATH); a request "
        "picks one by its \"model\" name; more can be loaded live (POST /v1/load_lora_adapter)",
        commands=ENGINE_COMMANDS, metavar="NAME=PATH", check=lambda v: parse_loras(v), join=",")
    max_loras: int = opt(
        4, "LoRA: adapters resident at once (more may be registered: the least recently used idle one is "
        "evicted and read again when needed)", commands=ENGINE_COMMANDS, metavar="N")
    max_lora_rank: int = opt(64, "LoRA: the largest adapter rank accepted", commands=ENGINE_COMMANDS, metavar="R")
    parallel_timeout: float = opt(
        60.0, "tensor parallel: seconds a collective may wait for a rank before the group is declared failed",
        commands=ENGINE_COMMANDS, metavar="S")

    # A decoder served as an embedder (engine/pooling.py): its final hidden states pooled per input
    # (/v1/embeddings) instead of tokens generated.
    task: str = opt("generate", "generate (default) | embed: pool the model's final hidden states into embeddings "
                    "(/v1/embeddings; no generation; see --pooling, --normalize)", commands=(SERVE,),
                    choices=TASKS)
    pooling: str = opt("last", "--task embed: the vector of an input is its last token's final hidden state "
                       "(last: Qwen3-Embedding's), their mean (mean) or the first token's (cls)", commands=(SERVE,),
                       choices=("last", "mean", "cls"))
    normalize: bool = opt(True, "--task embed: L2-normalise each embedding (--no-normalize: the raw pooled vector)",
                          commands=(SERVE,), negatable=True)

    def __post_init__(self) -> None:
        self._check_task()
        if self.lora is not None:
            parse_loras(self.lora)  # (several processes are refused when the engine is built)
        if not 1 <= self.max_loras <= 1024:
            raise ValueError(f"max_loras must be in [1, 1024] (got {self.max_loras})")
        if not 1 <= self.max_lora_rank <= 1024:
            raise ValueError(f"max_lora_rank must be in [1, 1024] (got {self.max_lora_rank})")
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
        if not 0.1 <= self.gpu_memory_utilization <= 0.98:
            raise ValueError(f"gpu_memory_utilization must be in [0.1, 0.98] (got {self.gpu_memory_utilization})")
        if self.cuda_graph_max_bs < 1:
            raise ValueError(f"cuda_graph_max_bs must be >= 1 (got {self.cuda_graph_max_bs})")
        if self.weights not in WEIGHT_MODES:
            raise ValueError(f"weights must be one of {', '.join(WEIGHT_MODES)} (got {self.weights!r})")
        if self.weights == "stored":
            if self.kernels == "eager":
                raise ValueError("--weights stored runs on tripod's kernels; it cannot be combined with --kernels eager")
            if _ALIASES.get(self.dtype, self.dtype) not in ("auto", "float32", "bfloat16"):
                raise ValueError(
                    "--weights stored runs on tripod's CPU kernels with bfloat16 or float32 activations; "
                    f"use --dtype auto, bfloat16 or float32 (got {self.dtype!r})"
                )
        if self.speculative is not None:
            parse_speculative(self.speculative)  # raises with what to change
        if not 1 <= self.num_draft_tokens <= 64:
            raise ValueError(f"num_draft_tokens must be in [1, 64] (got {self.num_draft_tokens})")
        if self.spec_max_batch < 0:
            raise ValueError(f"spec_max_batch must be >= 0 (got {self.spec_max_batch})")
        if self.policy not in ("lpm", "fcfs"):
            raise ValueError(f"policy must be 'lpm' or 'fcfs' (got {self.policy!r})")
        if self.kv_disk_size <= 0:
            raise ValueError(f"kv_disk_size must be > 0 GB (got {self.kv_disk_size})")
        if self.max_state_slots is not None and self.max_state_slots < 1:
            raise ValueError(f"max_state_slots must be >= 1 (got {self.max_state_slots})")
        if self.max_state_snapshots is not None and self.max_state_snapshots < 0:
            raise ValueError(f"max_state_snapshots must be >= 0 (got {self.max_state_snapshots})")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2 (got {self.max_model_len})")
        self._check_parallel()

    def _check_task(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {', '.join(TASKS)} (got {self.task!r})")
        if self.pooling not in ("last", "mean", "cls"):
            raise ValueError(f"pooling must be last, mean or cls (got {self.pooling!r})")

    def check_task(self) -> None:
        """What ``--task embed`` cannot combine with; checked when an engine is built (as
        ``check_parallel``), so that a config naming both still round-trips through the command line."""
        if self.task != "embed":
            return
        if self.world_size > 1:
            raise ValueError("--task embed runs the model in one process: drop --tensor/pipeline/data-parallel-size "
                             "(use --replicas)")
        for flag, on in (("--speculative", self.speculative is not None), ("--kv-disk", self.kv_disk is not None),
                         ("--lora", self.lora is not None)):
            if on:
                raise ValueError(f"--task embed generates nothing: {flag} does not apply to it")

    def _check_parallel(self) -> None:
        if min(self.tensor_parallel_size, self.pipeline_parallel_size, self.data_parallel_size) < 1:
            raise ValueError("tensor_parallel_size, pipeline_parallel_size and data_parallel_size must be >= 1 "
                             f"(got {self.tensor_parallel_size}, {self.pipeline_parallel_size}, "
                             f"{self.data_parallel_size})")
        if self.parallel_timeout <= 0:
            raise ValueError(f"parallel_timeout must be > 0 (got {self.parallel_timeout})")
        if self.parallel_backend not in ("local", "ray"):
            raise ValueError(f"parallel_backend must be 'local' or 'ray' (got {self.parallel_backend!r})")
        if self.parallel_placement not in ("pack", "spread", "strict-pack", "strict-spread"):
            raise ValueError("parallel_placement must be pack, spread, strict-pack or strict-spread "
                             f"(got {self.parallel_placement!r})")

    def check_parallel(self) -> None:
        """What a model over several processes cannot combine with (yet); checked when an engine
        is built, so that a config naming both still round-trips through the command line."""
        if self.data_parallel_size > 1 and self.world_size != self.data_parallel_size:
            raise ValueError("--data-parallel-size already splits the MoE/MLP layers over its ranks: combining it "
                             "with --tensor-parallel-size or --pipeline-parallel-size is not built yet")
        if self.enable_expert_parallel and self.tensor_parallel_size * self.data_parallel_size == 1:
            raise ValueError("--enable-expert-parallel splits experts over the ranks: "
                             "give --tensor-parallel-size or --data-parallel-size 2 or more")
        if self.kv_disk is not None and not self.enable_prefix_cache:
            raise ValueError("--kv-disk is a tier under the prefix cache: it cannot be combined with --no-prefix-cache")
        if self.world_size == 1:
            return
        if self.kv_disk is not None:
            raise ValueError("--kv-disk is not built for a model over several processes yet (each rank holds a "
                             "shard of the KV); drop --kv-disk or --tensor/pipeline-parallel-size")
        if self.weights != "dequantized":
            raise ValueError(f"a model over several processes runs dequantized weights for now (got --weights {self.weights})")
        if self.speculative is not None and parse_speculative(self.speculative).kind != "ngram":
            raise ValueError("a model over several processes supports --speculative ngram only for now (a draft "
                             f"model would run unsharded on rank 0; got {self.speculative!r})")

    @property
    def world_size(self) -> int:
        """How many processes run the model (tensor x pipeline x data parallel)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.data_parallel_size

    def compute_path(self, dtype: torch.dtype) -> str:
        """"eager" (the reference path) or "optimized", for this config's ``kernels`` mode."""
        if self.weights == "stored":
            return "optimized"
        if self.kernels == "auto":
            import torch

            if self.device.startswith("cuda"):
                return "optimized"  # the Triton kernels, in any dtype
            return "eager" if dtype == torch.float32 else "optimized"
        return "eager" if self.kernels == "eager" else "optimized"

    @property
    def triton(self) -> bool:
        """Whether the Triton backend computes: asked for, or the optimized path on a GPU."""
        return self.kernels == "triton" or (self.device.startswith("cuda") and self.kernels in ("auto", "optimized"))

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
        if self.triton and device.type == "cpu":  # Triton's interpreter: NumPy has no bfloat16
            if name == "bfloat16":
                raise ValueError("Triton's interpreter (the Triton kernels on the CPU) has no bfloat16: "
                                 "use --dtype float32 (the default there)")
            name = "float32"
        if name == "auto":
            name = "bfloat16" if fast_bf16(device) else "float32"
        if name == "float16" and device.type != "cuda":
            raise ValueError("float16 is only supported on CUDA; use bfloat16 or float32 on the CPU")
        import torch

        dtype: torch.dtype = getattr(torch, name)
        return dtype


def dtype_alias(name: str) -> str:
    """``--dtype``'s canonical name (``fp32`` -> ``float32``, ...)."""
    return _ALIASES.get(name, name)


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


@dataclass(frozen=True, slots=True)
class SamplingOptions:
    """The sampling options of ``tripod generate``/``tripod chat``: an interactive session's
    defaults (greedy, up to 256 tokens), validated where they land (``SamplingParams`` in process,
    the server's request checks with ``--url``)."""

    max_tokens: int = opt(256, "most tokens per answer", commands=(GENERATE, CHAT))
    temperature: float = opt(0.0, "0 = greedy (default)", commands=(GENERATE, CHAT))
    top_p: float = opt(1.0, "nucleus sampling: the smallest set of tokens whose probability reaches P (1 = off)",
                        commands=(GENERATE, CHAT))
    top_k: int = opt(-1, "sample among the K most likely tokens (-1 = off)", commands=(GENERATE, CHAT))
    min_p: float = opt(0.0, "drop tokens less likely than P times the most likely one (0 = off)",
                        commands=(GENERATE, CHAT))
    repetition_penalty: float = opt(1.0, "penalize tokens already in the prompt or the answer (1 = off)",
                                      commands=(GENERATE, CHAT))
    seed: int | None = opt(None, "seed of the sampling noise: the same seed gives the same answer",
                            commands=(GENERATE, CHAT))
    ignore_eos: bool = opt(False, "go on past the end-of-sequence token, up to --max-tokens", commands=(GENERATE, CHAT))


# The configs of the processes around the engine live in their own module; named here too.
from tripod.config_services import (  # noqa: E402
    ROUTING_POLICIES,
    FleetConfig,
    RouterConfig,
    ServerConfig,
    check_tls,
)

__all__ = [
    "BENCH_DIR_HELP", "CHAINS_SERVE", "CHAT", "ENGINE_COMMANDS", "GENERATE", "KERNEL_LEVELS", "KERNEL_MODES",
    "ROUTE", "ROUTING_POLICIES", "SERVE", "WEIGHT_MODES", "EngineConfig", "FleetConfig", "RouterConfig",
    "SamplingOptions", "ServerConfig", "SpeculativeSpec", "check_tls", "fast_bf16", "native_bf16",
    "parse_speculative",
]
