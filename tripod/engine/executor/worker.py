"""A rank > 0 of a group, however it is started (a local process or a Ray actor): its place in
the group, its shard of the model, its KV pool and model runner, and the forward of each
``RankStep`` rank 0 sends."""

from __future__ import annotations

import dataclasses
import socket

import torch

from tripod.engine.executor.group import RankStep, WorkerSpec, init_group, weight_bytes
from tripod.engine.model_runner import ModelRunner
from tripod.kernels.startup import start_kernels
from tripod.loader import load_model
from tripod.memory.kv_pool import slots_from_budget
from tripod.protocol.stats import RankCard


class RankWorker:
    """What a rank > 0 holds, however it is started: its place in the group, its shard of the
    model, then (``make_pool``, once rank 0 has sized the pools) its KV pool and model runner."""

    def __init__(self, spec: WorkerSpec) -> None:
        torch.set_num_threads(spec.threads)
        self.spec = spec
        config = spec.config
        self.device = config.torch_device()
        self.dtype = config.torch_dtype(self.device)
        self.tp, self.pp = init_group(config, spec.rank, spec.init_method)
        self.loaded = load_model(config.model, self.dtype, self.device, weights=config.weights, tp=self.tp,
                                 expert_parallel=config.enable_expert_parallel, pp=self.pp)
        self.pool_spec = self.loaded.config.pool_spec(self.tp, num_layers=len(self.loaded.model.layers))
        # the slots this rank's memory allows (rank 0 takes the group's smallest)
        self.budget = slots_from_budget(kv_cache_tokens=config.kv_cache_tokens, kv_mem_fraction=config.kv_mem_fraction,
                                        bytes_per_token=self.pool_spec.bytes_per_token(self.dtype), device=self.device,
                                        max_tokens_cap=config.max_kv_cache_tokens)
        self.runner: ModelRunner | None = None

    def make_pool(self, num_slots: int) -> RankCard:
        """A pool of rank 0's ``num_slots`` (every rank holds as many), the kernels, the runner."""
        config, loaded, dtype, device, pool_spec = self.spec.config, self.loaded, self.dtype, self.device, self.pool_spec
        pool = pool_spec.make(num_slots, dtype, device, base=self.spec.rank * num_slots if self.tp.dp_attention else 0)
        path = config.compute_path(dtype)
        start_kernels(dataclasses.replace(config, kernels=config.kernels if config.kernels != "auto" else "optimized")
                      if path == "optimized" else config, path, device)
        context = min(config.max_model_len or loaded.config.max_position_embeddings,
                      loaded.config.max_position_embeddings)
        self.runner = ModelRunner(loaded.model, pool, device, use_mirror=False, path=path,
                                  max_len=min(context, num_slots), stored=config.weights == "stored",
                                  level=config.kernel_level)
        return RankCard(rank=self.spec.rank, weight_bytes=weight_bytes(loaded.model),
                        kv_bytes_per_token=pool_spec.bytes_per_token(dtype), kv_slots=num_slots,
                        node=socket.gethostname())

    def run(self, step: RankStep) -> None:
        """Rank 0's batch on this rank's shard and pool, on the backend rank 0 runs."""
        runner = self.runner
        assert runner is not None, "a step before the pool was made"
        backend = runner.scoring_backend() if step.scoring else runner.backend
        if backend.form != step.form:
            raise RuntimeError(f"rank 0 runs {step.form} but this rank {backend.form}: the ranks must compute alike")
        step.batch.bind(backend)
        runner.model(step.batch, runner.pool)
