"""KV memory: a token-slot allocator and the per-layer K/V tensors it indexes.

A *slot* is one token's K and V in every layer. Slots are handed out one token at a time
(page size 1), so a request's KV may be scattered; attention gathers it through the
request's slot list.
"""

from __future__ import annotations

import torch


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

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

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
