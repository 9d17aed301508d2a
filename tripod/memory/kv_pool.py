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

    def make(self, num_slots: int, dtype: torch.dtype, device: torch.device) -> KVPool | LatentPool:
        if self.kind == "latent":
            return LatentPool(num_slots, self.num_layers, self.latent_dim, dtype, device)
        return KVPool(num_slots, self.num_layers, self.num_kv_heads, self.head_dim, dtype, device)


class SlotAllocator:
    """Owns the free list of KV slots.

    Invariant: a slot id is either in the free list or handed out, never both; ``free``
    rejects a slot that is already free (a double free is an engine bug).
    """

    def __init__(self, num_slots: int) -> None:
        if num_slots < 2:
            raise ValueError(f"the KV pool needs at least 2 token slots (got {num_slots})")
        self.num_slots = num_slots
        # Pop from the end: low slot ids are handed out first, which keeps small runs compact.
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._is_free = bytearray(b"\x01") * num_slots

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """Hand out ``n`` slots, or None (and nothing) if fewer are free."""
        if n > len(self._free):
            return None
        if n == 0:
            return []
        out = self._free[-n:][::-1]  # ascending: a prefill chunk gets a run of slot ids
        del self._free[-n:]
        for s in out:
            self._is_free[s] = 0
        return out

    def free(self, slots: list[int]) -> None:
        for s in slots:
            assert not self._is_free[s], f"double free of KV slot {s}"
            self._is_free[s] = 1
        self._free.extend(slots)

    def free_set(self) -> set[int]:
        return set(self._free)


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
                 device: torch.device) -> None:
        self.num_slots = num_slots
        self.latent_dim = latent_dim
        self.kv = torch.zeros((num_layers, num_slots, latent_dim), dtype=dtype, device=device)
        self.allocator = SlotAllocator(num_slots)

    def write(self, layer: int, slots: torch.Tensor, latent: torch.Tensor) -> None:
        self.kv[layer].index_copy_(0, slots, latent)

    def gather(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """The latents of ``slots`` (any shape ``S``): ``[*S, latent_dim]``."""
        return self.kv[layer].index_select(0, slots.reshape(-1)).view(*slots.shape, self.latent_dim)


Pool = KVPool | LatentPool


def slots_from_budget(
    *,
    kv_cache_tokens: int | None,
    kv_mem_fraction: float,
    bytes_per_token: int,
    device: torch.device,
    max_tokens_cap: int,
) -> int:
    """How many token slots to preallocate: an explicit count, else a fraction of free memory."""
    if kv_cache_tokens is not None:
        if kv_cache_tokens < 2:
            raise ValueError(f"kv_cache_tokens must be >= 2 (got {kv_cache_tokens})")
        return kv_cache_tokens
    if not 0.0 < kv_mem_fraction <= 0.95:
        raise ValueError(f"kv_mem_fraction must be in (0, 0.95] (got {kv_mem_fraction})")
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
    else:
        free = _available_host_memory()
    n = int(free * kv_mem_fraction) // bytes_per_token
    return max(2, min(n, max_tokens_cap))


def _available_host_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30  # conservative guess where /proc is absent
