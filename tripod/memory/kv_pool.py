"""KV memory: a token-slot allocator and the per-layer tensors it indexes.

A *slot* is one token's attention state in every layer: its K and V per KV head (``KVPool``, for
MHA/GQA models) or multi-head latent attention's compressed latent (``LatentPool``). Slots are
handed out one token at a time (page size 1), so a request's state may be scattered; attention
gathers it through the request's slot list. The allocator, the radix cache and eviction see
slots only, so they work the same over either pool.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """The shape of one token's state in every layer (models say which: ``ModelConfig.pool_spec``)."""

    num_layers: int
    kind: Literal["mha", "latent"]
    num_kv_heads: int = 0
    head_dim: int = 0
    latent_dim: int = 0

    def values_per_token(self) -> int:
        if self.kind == "latent":
            return self.num_layers * self.latent_dim
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        return self.values_per_token() * torch.empty((), dtype=dtype).element_size()

    def make(self, num_slots: int, dtype: torch.dtype, device: torch.device, *, base: int = 0,
             ranks: int = 1) -> KVPool | LatentPool:
        """A pool of ``num_slots`` slots. Data-parallel attention (``ranks`` > 1, latent pools
        only): this rank's pool holds the global slot ids ``[base, base + num_slots)``, and its
        allocator (rank 0's is the one the scheduler uses) hands out ``ranks`` such ranges."""
        if self.kind == "latent":
            return LatentPool(num_slots, self.num_layers, self.latent_dim, dtype, device, base=base, ranks=ranks)
        if base or ranks > 1:
            raise ValueError("per-rank slot ranges (data-parallel attention) are built for latent (MLA) pools only")
        return KVPool(num_slots, self.num_layers, self.num_kv_heads, self.head_dim, dtype, device)


class SlotAllocator:
    """Owns the free list of KV slots.

    ``ranks`` > 1 (data-parallel attention): the slot ids are ``ranks`` equal ranges, rank d's
    ``[d * per_rank, (d + 1) * per_rank)`` held in rank d's pool; a request's slots all come
    from the range of the rank that runs its attention (``alloc(n, rank)``).

    Invariant: a slot id is either in the free list or handed out, never both; ``free``
    rejects a slot that is already free (a double free is an engine bug).
    """

    def __init__(self, num_slots: int, ranks: int = 1) -> None:
        if num_slots < 2 * ranks:
            raise ValueError(f"the KV pool needs at least 2 token slots per rank (got {num_slots} over {ranks})")
        if num_slots % ranks:
            raise ValueError(f"{num_slots} KV slots do not split evenly over {ranks} ranks")
        self.num_slots = num_slots
        self.ranks = ranks
        self.per_rank = num_slots // ranks
        # Pop from the end: low slot ids are handed out first, which keeps small runs compact.
        self._free: list[list[int]] = [list(range((d + 1) * self.per_rank - 1, d * self.per_rank - 1, -1))
                                       for d in range(ranks)]
        self._is_free = bytearray(b"\x01") * num_slots

    @property
    def num_free(self) -> int:
        return sum(len(f) for f in self._free)

    def free_on(self, rank: int) -> int:
        """Free slots in ``rank``'s range."""
        return len(self._free[rank])

    def rank_of(self, slot: int) -> int:
        return slot // self.per_rank

    def alloc(self, n: int, rank: int = 0) -> list[int] | None:
        """Hand out ``n`` slots of ``rank``'s range, or None (and nothing) if fewer are free."""
        free = self._free[rank]
        if n > len(free):
            return None
        if n == 0:
            return []
        out = free[-n:][::-1]  # ascending: a prefill chunk gets a run of slot ids
        del free[-n:]
        for s in out:
            self._is_free[s] = 0
        return out

    def free(self, slots: list[int]) -> None:
        for s in slots:
            assert not self._is_free[s], f"double free of KV slot {s}"
            self._is_free[s] = 1
        if self.ranks == 1:
            self._free[0].extend(slots)
        else:
            for s in slots:
                self._free[s // self.per_rank].append(s)

    def free_set(self) -> set[int]:
        return {s for f in self._free for s in f}


class KVPool:
    """Per-layer K/V, preallocated: ``kv[layer]`` is ``[num_slots, 2, num_kv_heads, head_dim]``
    (K and V of a slot side by side, so one row gather fetches both).

    Zero-initialised so that padded (masked) reads in batched attention never see NaN.
    """

    kind = "mha"

    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_slots = num_slots
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.kv = torch.zeros((num_layers, num_slots, 2, num_kv_heads, head_dim), dtype=dtype, device=device)
        self._rows = self.kv.view(num_layers, num_slots, 2 * num_kv_heads * head_dim)
        self.allocator = SlotAllocator(num_slots)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.kv[layer].index_copy_(0, slots, torch.stack((k, v), dim=1))

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``slots`` (any shape ``S``): two views ``[*S, num_kv_heads, head_dim]``.

        NOTE: ``index_select`` on whole rows, not advanced indexing: several times faster on
        the CPU, and it fetches K and V in one pass.
        """
        rows = self._rows[layer].index_select(0, slots.reshape(-1))
        g = rows.view(*slots.shape, 2, self.num_kv_heads, self.head_dim)
        return g.select(-3, 0), g.select(-3, 1)


class LatentPool:
    """Per-layer latent state, preallocated: ``kv[layer]`` is ``[num_slots, latent_dim]`` (MLA's
    normalized KV latent followed by its rotated shared key). Zero-initialised like ``KVPool``."""

    kind = "latent"

    def __init__(self, num_slots: int, num_layers: int, latent_dim: int, dtype: torch.dtype,
                 device: torch.device, *, base: int = 0, ranks: int = 1) -> None:
        self.num_slots = num_slots  # this rank's (data-parallel attention: one range of the group's)
        self.latent_dim = latent_dim
        self.base = base  # the global slot id of this pool's first row
        self.kv = torch.zeros((num_layers, num_slots, latent_dim), dtype=dtype, device=device)
        self.allocator = SlotAllocator(num_slots * ranks, ranks)

    def _local(self, slots: torch.Tensor) -> torch.Tensor:
        # NOTE: padding in a batch's slot table is slot 0, below a later rank's range: it maps to
        # row 0 here (masked out); a slot above the range fails the index check.
        return slots if not self.base else (slots - self.base).clamp_(min=0)

    def write(self, layer: int, slots: torch.Tensor, latent: torch.Tensor) -> None:
        self.kv[layer].index_copy_(0, self._local(slots), latent)

    def gather(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """The latents of ``slots`` (any shape ``S``): ``[*S, latent_dim]``."""
        return self.kv[layer].index_select(0, self._local(slots).reshape(-1)).view(*slots.shape, self.latent_dim)


Pool = KVPool | LatentPool


def slots_from_budget(
    *,
    kv_cache_tokens: int | None,
    kv_mem_fraction: float,
    bytes_per_token: int,
    device: torch.device,
    max_tokens_cap: int,
    gpu_memory_utilization: float = 0.9,
) -> int:
    """How many token slots to preallocate: an explicit count; on a GPU, what
    ``gpu_memory_utilization`` of its memory leaves after the weights (``gpu_kv_bytes``); on the
    CPU, a fraction of free memory."""
    if kv_cache_tokens is not None:
        if kv_cache_tokens < 2:
            raise ValueError(f"kv_cache_tokens must be >= 2 (got {kv_cache_tokens})")
        return kv_cache_tokens
    if not 0.0 < kv_mem_fraction <= 0.95:
        raise ValueError(f"kv_mem_fraction must be in (0, 0.95] (got {kv_mem_fraction})")
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return max(2, gpu_kv_bytes(free, total, gpu_memory_utilization) // bytes_per_token)
    free = _available_host_memory()
    n = int(free * kv_mem_fraction) // bytes_per_token
    return max(2, min(n, max_tokens_cap))


def available_memory(device: torch.device) -> int:
    """Bytes free for new buffers on ``device`` (a GPU's free memory; the host's available memory)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return _available_host_memory()


GPU_RESERVE = 2 << 30  # activations, the decode graphs' pool, cuBLAS workspaces, the sampler's rows


def gpu_kv_bytes(free: int, total: int, utilization: float, reserve: int = GPU_RESERVE) -> int:
    """The KV pool's share of a GPU, measured after the weights are loaded: ``utilization`` of
    its memory, less what is already in use (the weights, another process), less ``reserve``."""
    used = total - free
    budget = int(total * utilization) - used - reserve
    if budget <= 0:
        raise ValueError(f"no GPU memory is left for the KV cache: {used / 2**30:.1f} GiB of {total / 2**30:.1f} GiB "
                         f"is in use and --gpu-memory-utilization {utilization} allows "
                         f"{total * utilization / 2**30:.1f} GiB (less a {reserve / 2**30:.1f} GiB reserve); raise "
                         "it, or give --kv-cache-tokens")
    return budget


def _available_host_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30  # conservative guess where /proc is absent
