"""Building an engine from its config: the weights, a draft model, the KV pool sized for both, the
prefix cache over it (with the disk tier under it, ``--kv-disk``), the LoRA adapters, the CPU
kernels (and the threads while they build), the model runner, the sampler and the speculator's
proposer. ``Engine.__init__`` calls ``build`` and hands each part to the constructors that use it:
nothing is wired across objects afterwards."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from tripod.config import EngineConfig, parse_loras, parse_speculative
from tripod.engine.executor.group import (
    WorkerGroup,
    resident_weight_bytes,
    threads_per_rank,
    weight_bytes,
)
from tripod.engine.executor.local import LocalWorkers
from tripod.engine.executor.ray_group import RayWorkers
from tripod.engine.lora import LoraRegistry
from tripod.engine.model_runner import ModelRunner
from tripod.engine.pooling import Pooler
from tripod.engine.sampler import Sampler
from tripod.engine.speculative.factory import extra_bytes_per_token, load_draft, make_proposer
from tripod.engine.speculative.proposer import Proposer
from tripod.engine.vision import VisionInputs, vision_obstacle
from tripod.kernels import unavailable_reason
from tripod.kernels.startup import BuildThreads, start_kernels
from tripod.layers.mlp import GatedMLP
from tripod.layers.parallel import SINGLE, SINGLE_STAGE, ParallelGroup, PipeStage
from tripod.loader import LoadedModel, load_model, load_tokenizer
from tripod.loader.weights_mode import resolve_weights
from tripod.memory.kv_blocks import model_identity
from tripod.memory.kv_pool import Pool, available_memory, slots_from_budget
from tripod.memory.prefix_cache import PrefixCache, TreeNode
from tripod.memory.radix_cache import RadixCache
from tripod.memory.state_pool import StatePool, check_fits, state_slots
from tripod.memory.state_snapshots import StateSnapshots
from tripod.memory.tiered_cache import SnapshotMaker, TieredCache
from tripod.protocol.stats import ParallelCard, RankCard

log = logging.getLogger("tripod.engine.engine")


def resolve_config(config: EngineConfig | None, model: str | None, dtype: str, device: str,
                   overrides: dict[str, Any], loaded: LoadedModel | None = None) -> EngineConfig:
    """The engine's config: the given one with the explicit arguments winning, or one built from
    them; ``--weights auto`` resolved (to a given loaded model's weights, or for the model here)."""
    cfg = _merged_config(config, model, dtype, device, overrides)
    if cfg.weights == "auto" and loaded is not None:
        return replace(cfg, weights=loaded.weights)
    return resolve_weights(cfg)


def _merged_config(config: EngineConfig | None, model: str | None, dtype: str, device: str,
                   overrides: dict[str, Any]) -> EngineConfig:
    if config is None:
        return EngineConfig(model=model, dtype=dtype, device=device, **overrides)
    if model is not None:
        overrides["model"] = model
    if dtype != "auto":
        overrides["dtype"] = dtype
    if device != "cpu":
        overrides["device"] = device
    return replace(config, **overrides) if overrides else config


@dataclass(slots=True)
class EngineParts:
    """What ``build`` makes; the engine keeps each as an attribute of the same name."""

    device: torch.device
    dtype: torch.dtype
    loaded: LoadedModel
    draft: LoadedModel | None
    pool: Pool
    num_slots: int
    bytes_per_slot: int  # the target's and the draft's K/V for one token, and any extra
    kv_bytes_per_token: int  # this rank's, under tensor parallelism
    context_len: int
    threads: BuildThreads
    cache: PrefixCache  # over the pool (a TieredCache with --kv-disk)
    loras: LoraRegistry | None  # None: this model/layout serves no adapters
    runner: ModelRunner
    sampler: Sampler
    proposer: Proposer | None
    eos_ids: frozenset[int]
    vision: VisionInputs  # a vision-language model's images (inert for a text-only model)
    group: WorkerGroup | None = None  # tensor parallel: ranks 1..T-1
    ranks: tuple[RankCard, ...] = ()  # tensor parallel: what each rank holds, rank 0 first
    states: StatePool | None = None  # a hybrid model's recurrent states (one slot per running request)
    snapshots: StateSnapshots | None = None  # ... and their snapshots on prefix-cache nodes


def load_weights(config: EngineConfig, loaded: LoadedModel | None, dtype: torch.dtype,
                 device: torch.device, tp: ParallelGroup = SINGLE, pp: PipeStage = SINGLE_STAGE) -> LoadedModel:
    if loaded is not None and config.weights != "dequantized" and loaded.weights != config.weights:
        if config.weights == "fp8":
            raise ValueError("--weights fp8 needs the model loaded with its FP8 weights (load_model(..., weights='fp8'))")
        raise ValueError("--weights stored needs the model loaded with its stored weights (load_model(..., weights='stored'))")
    # the engine will keep only the stored form (release_dense_stored below): the loader then never
    # makes the dense copy of the projections it takes as stored
    stored_only = (config.weights == "stored" and not config.triton and config.kernels != "eager" and tp.size == 1
                   and pp.stages == 1 and device.type == "cpu" and unavailable_reason(config.kernel_level) is None)
    return loaded or load_model(config.model, dtype, device, weights=config.weights, tp=tp,
                                expert_parallel=config.enable_expert_parallel, pp=pp, stored_only=stored_only)


def eos_ids_of(loaded: LoadedModel) -> frozenset[int]:
    eos = set(loaded.config.eos_token_ids)
    if getattr(loaded.tokenizer, "eos_token_id", None) is not None:
        eos.add(int(loaded.tokenizer.eos_token_id))
    return frozenset(eos)


def make_group(config: EngineConfig) -> WorkerGroup:
    """Start ranks 1..N-1: processes on this machine, or Ray actors placed over a cluster's nodes."""
    if config.parallel_backend == "ray":
        return RayWorkers(config)  # (Ray itself is imported only here)
    return LocalWorkers(config)


def build(config: EngineConfig, loaded: LoadedModel | None) -> EngineParts:
    """Every part of an engine, in dependency order (the pool is sized once the draft is known)."""
    config.check_parallel()
    config.check_task()
    if config.world_size > 1 and loaded is None:  # refused before any worker starts
        mc = load_tokenizer(config.model).config
        if mc.hybrid is not None:
            raise ValueError(hybrid_refusal(f"--tensor-parallel-size/--pipeline-parallel-size/--data-parallel-size (the {mc.architecture} "
                                            "model over several processes)"))
        if mc.v4 is not None:
            raise ValueError("DeepSeek-V4 runs in one process for now (no --tensor-parallel-size/--pipeline-parallel-size/--data-parallel-size): "
                             "use --replicas")
        if (why := vision_obstacle(config, mc)) is not None:
            raise ValueError(why)
        if config.data_parallel_size > 1 and mc.mla is None:
            raise ValueError("--data-parallel-size runs the attention of MLA models (DeepSeek-V2/V3) data-parallel; "
                             f"{mc.architecture} has none: use --tensor-parallel-size or --replicas")
    group = make_group(config) if config.world_size > 1 else None
    try:
        return _build(config, loaded, group)
    except BaseException:
        if group is not None:
            group.close()
        raise


def _build(config: EngineConfig, loaded: LoadedModel | None, group: WorkerGroup | None) -> EngineParts:
    threads = threads_per_rank(config, group.size) if group is not None else config.num_threads
    if threads:
        torch.set_num_threads(threads)
    device = config.torch_device()
    dtype = config.torch_dtype(device)
    tp, pp = (group.tp, group.pp) if group is not None else (SINGLE, SINGLE_STAGE)
    if group is not None and loaded is not None:
        raise ValueError("an engine over several processes loads its own shard on each rank: give no loaded model")
    loaded = load_weights(config, loaded, dtype, device, tp, pp)
    mc = loaded.config
    if (why := vision_obstacle(config, mc)) is not None:
        raise ValueError(why)
    vision = VisionInputs(loaded.model)
    check_hybrid(config, mc)
    check_state_rollback(config, loaded)
    stage_layers = len(loaded.model.layers)
    draft = load_draft(config, loaded, dtype, device)
    per_token = mc.pool_spec(tp, stage_layers).bytes_per_token(dtype) + extra_bytes_per_token(config, loaded, dtype)
    if draft is not None:
        # NOTE: the draft's K/V live at the target's slot ids: one token slot costs both.
        per_token += draft.config.pool_spec().bytes_per_token(dtype)
    num_slots = slots_from_budget(kv_cache_tokens=config.kv_cache_tokens, kv_mem_fraction=config.kv_mem_fraction,
                                  bytes_per_token=per_token, device=device, max_tokens_cap=config.max_kv_cache_tokens,
                                  gpu_memory_utilization=config.gpu_memory_utilization)
    ranks: tuple[RankCard, ...] = ()
    dp = config.data_parallel_size if group is not None and tp.dp_attention else 1
    if group is not None:  # every rank sized its pool: the group holds the smallest
        num_slots, cards = group.wait_ready(num_slots)
        ranks = (RankCard(rank=0, weight_bytes=weight_bytes(loaded.model),
                          kv_bytes_per_token=mc.pool_spec(tp, stage_layers).bytes_per_token(dtype), kv_slots=num_slots,
                          node=group.node),
                 *cards)
    # (data-parallel attention: this pool is rank 0's range; its allocator hands out every rank's)
    pool = mc.pool_spec(tp, stage_layers).make(num_slots, dtype, device, ranks=dp)
    kv_bytes = mc.pool_spec(tp, stage_layers).bytes_per_token(dtype)
    if mc.mla is not None:
        log.info("MLA latent KV: %d bytes per token (the same model with MHA: %d)", kv_bytes,
                 mc.mha_equivalent_spec().bytes_per_token(dtype))
    states, snapshots_of = make_states(config, loaded, device)
    context_len = min(config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
    max_len = min(context_len, num_slots)
    path = config.compute_path(dtype)
    # NOTE: every rank must run the same backend at every step, so a group waits for the kernels.
    if not config.triton:
        start_kernels(config, path, device, wait=True if group is not None else None)
    build_threads = BuildThreads()
    card = ParallelCard(tensor_parallel_size=config.tensor_parallel_size,
                        pipeline_parallel_size=config.pipeline_parallel_size, data_parallel_size=dp,
                        expert_parallel=config.enable_expert_parallel, ranks=list(ranks),
                        kv_capacity_tokens=num_slots * dp) if group is not None else None
    loras = lora_registry(config, loaded, dtype, device)
    # --task embed: pooled, never sampled; a graph replay would not capture the hidden states it pools.
    embed = config.task == "embed"
    runner = ModelRunner(loaded.model, pool, device, use_mirror=config.decode_mirror and group is None, path=path, routes=True,
                         max_len=max_len, stored=config.weights == "stored", level=config.kernel_level, group=group,
                         parallel=card, lora_pool=loras.pool if loras is not None else None, triton=config.triton,
                         cuda_graphs=config.cuda_graphs and not embed, cuda_graph_max_bs=config.cuda_graph_max_bs,
                         pooler=Pooler(loaded.model, config.pooling, config.normalize) if embed else None,
                         vision=vision, states=states)
    if config.weights == "stored" and config.triton and loaded.path.endswith(".gguf"):
        raise ValueError("--weights stored with --kernels triton runs an AWQ / GPTQ / compressed-tensors folder's int4 "
                         "weights on the Triton W4A16 kernel; a GGUF's stored weights run on tripod's CPU kernels only")
    if config.weights == "stored" and not config.triton and runner.kernel_reason is not None:
        raise ValueError(f"--weights stored needs tripod's CPU kernels, which cannot run here: {runner.kernel_reason}")
    triton_card(config, runner, loaded)
    keep_stored_only(config, runner, loaded, group)
    sampler = Sampler(device, config.seed)
    proposer = make_proposer(config, loaded, draft, pool, sampler, path=path, max_len=max_len, device=device,
                              dtype=dtype)
    cache = make_cache(config, loaded, dtype, pool, states, snapshots_of)
    snapshots = cache.snapshots if isinstance(cache, TieredCache) else (
        snapshots_of(lambda: cache.tree.root) if isinstance(cache, RadixCache) and cache.enabled else None)
    return EngineParts(device=device, dtype=dtype, loaded=loaded, draft=draft, pool=pool, num_slots=num_slots,
                       bytes_per_slot=per_token, kv_bytes_per_token=kv_bytes, context_len=context_len,
                       threads=build_threads, cache=cache, loras=loras, snapshots=snapshots,
                       runner=runner, sampler=sampler, proposer=proposer, eos_ids=eos_ids_of(loaded), vision=vision,
                       group=group, ranks=ranks, states=states)


def triton_card(config: EngineConfig, runner: ModelRunner, loaded: LoadedModel) -> None:
    """``--weights stored`` on the Triton backend: the model card says which kernels compute the
    stored projections (the loader's card names the CPU paths)."""
    if config.weights == "stored" and config.triton and loaded.quantization_detail is not None:
        from tripod.layers.backends.triton import computed_by

        form = runner.backend.form  # (prepares the model's projections on the Triton backend)
        loaded.quantization_detail = {**loaded.quantization_detail, "computed_by": computed_by(loaded.model, form)}


def keep_stored_only(config: EngineConfig, runner: ModelRunner, loaded: LoadedModel, group: WorkerGroup | None) -> None:
    """``--weights stored`` on the CPU: drop the dense copies of the projections the stored form runs.
    NOTE: the kernels are loaded (start_kernels waits for them with stored weights), so every step
    runs the stored form; called before the first step and before the KV identity hashes the model."""
    if config.weights != "stored" or config.triton or group is not None:
        return
    freed = runner.release_dense_stored()
    log.info("weights: %.1f MiB resident (%.1f MiB of dense weights and unpacked codes given back: "
             "the stored projections keep only their packed codes)", resident_weight_bytes(loaded.model) / 2**20, freed / 2**20)


def hybrid_refusal(feature: str) -> str:
    return (f"{feature} is not supported on hybrid linear-attention models yet: their recurrent state "
            "would not follow it exactly; drop it")


def check_hybrid(config: EngineConfig, mc: Any) -> None:
    """What a hybrid (linear-attention) model cannot run with yet, refused at start with the reason."""
    if mc.hybrid is None:
        return
    if config.speculative is not None:
        kind = parse_speculative(config.speculative).kind
        if kind == "mtp":
            raise ValueError(hybrid_refusal(
                f"--speculative mtp ({mc.architecture}'s MTP layers are not loaded: the MTP block would "
                "need its own recurrent state per draft position); use ngram or draft:PATH"))
        if kind == "self":
            raise ValueError(hybrid_refusal(
                "--speculative self:K (the truncated model would advance the target's own linear-layer "
                "states while drafting); use ngram or draft:PATH"))
        if config.triton:
            raise ValueError(hybrid_refusal(
                "--speculative with --kernels triton (the Triton recurrence kernels keep no per-row state "
                "to roll a rejected draft back to); use the CPU kernels or drop --speculative"))
    if config.weights == "stored" and mc.hybrid.hf is not None and not str(config.model or "").lower().endswith(".gguf"):
        # (a hybrid GGUF's blocks run as stored: models/qwen3_5.py, models/hybrid.py, models/kimi_linear.py
        # load_stored; an integer-quantized folder of these families names its tensors otherwise)
        raise ValueError(f"--weights stored on {mc.architecture} runs a GGUF file's quantized blocks; an integer-"
                         "quantized (AWQ / GPTQ / compressed-tensors) folder of this family is not read as stored "
                         "yet: use --weights dequantized, or its GGUF")
    for feature, on in (("--lora", config.lora is not None),
                        ("--weights fp8", config.weights == "fp8"),
                        ("--overlap-schedule on", config.overlap_schedule == "on")):
        if on:
            raise ValueError(hybrid_refusal(feature))


def rolls_back_states(model: Any, config: EngineConfig) -> bool:
    """Whether every linear layer of ``model`` keeps its state after each verified row
    (``StateTrace``), so drafts — speculation and jump-forward — can be verified on it. The Triton
    recurrence kernels (``kernels/gpu/recurrent.py``) record no per-row states: not on that backend."""
    return bool(getattr(model, "traces_states", False)) and not config.triton


def check_state_rollback(config: EngineConfig, loaded: LoadedModel) -> None:
    """A hybrid whose mixers cannot roll their state back refuses speculation at start."""
    if loaded.config.hybrid is not None and config.speculative is not None and not rolls_back_states(loaded.model, config):
        raise ValueError(hybrid_refusal(f"--speculative ({loaded.config.architecture}'s linear layers keep no "
                                        "per-row state to roll a rejected draft back to)"))


def without_jump_forward(config: EngineConfig, parts: EngineParts) -> EngineConfig:
    """A hybrid model whose mixers cannot roll back (``rolls_back_states``): jump-forward off.
    NOTE: a verification advances the recurrent state over draft tokens it may reject; forced text
    is decoded token by token instead (the outputs are identical either way)."""
    if not config.jump_forward or parts.states is None or rolls_back_states(parts.loaded.model, config):
        return config
    log.info("hybrid model: jump-forward off (structured outputs decode forced text token by token)")
    return replace(config, jump_forward=False)


def make_states(config: EngineConfig, loaded: LoadedModel, device: torch.device
                ) -> tuple[StatePool | None, SnapshotMaker]:
    """A hybrid model's state pool — one slot per running request (``max_state_slots`` fewer), each
    every linear layer's float32 state — and the maker of its snapshot store over the prefix cache
    (``max_state_snapshots``, default as many); refused at start when both do not fit in memory."""
    spec_of = getattr(loaded.model, "state_spec", None)
    if spec_of is None:
        return None, lambda root: None
    spec = spec_of()
    slots = state_slots(config.max_running, config.max_state_slots)
    snaps = slots if config.max_state_snapshots is None else config.max_state_snapshots
    if snaps < 0:
        raise ValueError(f"max_state_snapshots must be >= 0 (got {snaps})")
    if not config.enable_prefix_cache:
        snaps = 0
    check_fits(spec, slots + snaps, available_memory(device), "free memory" if device.type == "cpu" else f"{device} memory")
    pool = StatePool(spec, slots, device)
    log.info("state pool: %d slots + %d prefix-cache snapshots x %.2f MiB (%d linear layers: conv window + "
             "recurrent state, float32) = %.1f MiB", slots, snaps, spec.bytes_per_slot() / 2**20, len(spec.layers),
             (slots + snaps) * spec.bytes_per_slot() / 2**20)

    def snapshots(root: Callable[[], TreeNode]) -> StateSnapshots | None:
        """The snapshot store over the tree whose current root ``root`` gives (None: none kept)."""
        return StateSnapshots(spec, snaps, device, root=root) if snaps else None

    return pool, snapshots


def overlaps(config: EngineConfig, runner: ModelRunner) -> bool:
    """Whether decode steps are laid out during the previous step's forward (engine/overlap.py):
    ``--overlap-schedule on``, or ``auto`` where a launch returns before the device is done (the
    Triton backend on a GPU). One process only: a tensor-parallel group's ranks get host batches."""
    if config.overlap_schedule == "off" or runner.group is not None:
        return False
    return config.overlap_schedule == "on" or (runner.triton and runner.device.type == "cuda")


def make_cache(config: EngineConfig, loaded: LoadedModel, dtype: torch.dtype, pool: Pool,
               states: StatePool | None = None, snapshots: SnapshotMaker | None = None) -> PrefixCache:
    """The prefix cache over ``pool``; with ``--kv-disk``, the tiered cache (the disk tier under it,
    keyed by this model, dtype and pool layout; a hybrid model's snapshots beside its blocks)."""
    if config.kv_disk is None:
        # (an embedding engine pools every prompt position: a cached prefix would not be recomputed)
        return RadixCache(pool.allocator, enabled=config.enable_prefix_cache and config.task != "embed")
    identity = kv_identity(config, loaded, dtype, pool)
    try:
        cache = TieredCache.open(config.kv_disk, int(config.kv_disk_size * 1e9), pool, identity,
                                 enabled=config.enable_prefix_cache,
                                 state_bytes=states.bytes_per_slot if states is not None else 0,
                                 snapshots=snapshots if states is not None else None)
    except OSError as e:
        raise ValueError(f"--kv-disk {config.kv_disk}: the directory cannot be used ({e})") from e
    tier = cache.tier
    log.info("kv disk tier: %s (%.1f GB, %d blocks of %d tokens found, %.0f MiB)", tier.dir, config.kv_disk_size,
             tier.entries, cache.block, tier.used_bytes / 2**20)
    return cache


def kv_identity(config: EngineConfig, loaded: LoadedModel, dtype: torch.dtype, pool: Pool) -> bytes:
    """What makes this engine's KV rows interchangeable with another's (the disk tier's and the KV
    transfer's key root): ``model_identity`` of the model, dtype, pool layout and compute path."""
    return model_identity(name=loaded.name, architecture=loaded.config.architecture, model=loaded.model,
                          dtype=dtype, pool=pool, extra={"quantization": loaded.quantization, "weights": config.weights,
                                                         "path": config.compute_path(dtype)})


def log_started(config: EngineConfig, parts: EngineParts, seconds: float) -> None:
    p = parts
    log.info(
        "tripod engine: model=%s (%s, stored as %s, weights %s) dtype=%s device=%s kv_slots=%d (%.0f MiB) "
        "context=%d compute=%s speculative=%s loaded in %.1fs",
        p.loaded.name, p.loaded.config.architecture, p.loaded.quantization,
        {"stored": "executed as stored", "fp8": "kept in FP8 (w8a16)"}.get(config.weights, "dequantized"),
        str(p.dtype).removeprefix("torch."), p.device, p.num_slots, p.num_slots * p.bytes_per_slot / 2**20,
        p.context_len, p.runner.describe(), config.speculative or "off", seconds,
    )


def lora_registry(config: EngineConfig, loaded: LoadedModel, dtype: torch.dtype,
                  device: torch.device) -> LoraRegistry | None:
    """The engine's LoRA adapters (``--lora``; more loaded live), or None where they cannot run:
    several processes, or a model whose projections are not the Llama-shaped ones (MLA, V4)."""
    mc, model = loaded.config, loaded.model
    why = None
    if config.world_size > 1:
        why = "the model runs over several processes"
    elif mc.mla is not None or mc.v4 is not None:
        why = f"{mc.architecture}'s attention has no q/k/v/o projections to adapt"
    elif mc.vision is not None:
        why = "LoRA adapters on a vision-language model are not supported"
    elif mc.hybrid is not None:
        why = hybrid_refusal("LoRA")
    if why is not None:
        if config.lora:
            raise ValueError(f"--lora: {why}")
        return None
    dense = {layer.layer for layer in model.layers if isinstance(layer.mlp, GatedMLP)}
    registry = LoraRegistry(mc, dtype, device, max_loras=config.max_loras, max_rank=config.max_lora_rank,
                            dense_layers=dense)
    for name, path in parse_loras(config.lora).items() if config.lora else ():
        registry.register(name, path)
        log.info("LoRA adapter %s loaded from %s", name, path)
    return registry
