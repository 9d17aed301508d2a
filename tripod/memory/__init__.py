"""KV memory, below ``layers`` and ``models`` (which use it) and ``engine`` (which owns it):
the token-slot allocator, the per-layer KV pool, and the slot table kernels read it through."""

from tripod.memory.kv_pool import KVPool, SlotAllocator, slots_from_budget
from tripod.memory.slot_table import SlotTable

__all__ = ["KVPool", "SlotAllocator", "SlotTable", "slots_from_budget"]
