"""KV memory, below ``layers`` and ``models`` (which use it) and ``engine`` (which owns it):
the token-slot allocator, the pools (K/V per head, or MLA's latent), and the slot table kernels
read the pool through."""

from tripod.memory.kv_pool import (
    KVPool,
    LatentPool,
    Pool,
    PoolSpec,
    SlotAllocator,
    slots_from_budget,
)
from tripod.memory.slot_table import SlotTable

__all__ = ["KVPool", "LatentPool", "Pool", "PoolSpec", "SlotAllocator", "SlotTable", "slots_from_budget"]
