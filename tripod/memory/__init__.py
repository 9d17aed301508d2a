"""KV memory, below ``layers`` and ``models`` (which use it) and ``engine`` (which owns it).

- ``kv_pool``: the token-slot allocator and the pools (K/V per head, or MLA's latent rows);
  ``slot_table``: the per-request rows of slot ids the kernels read the pool through;
  ``decode_mirror``: a dense copy of the decoding requests' KV for torch's attention.
- ``prefix_cache``: the ``PrefixCache`` protocol the scheduler talks to (match, lock, insert,
  evict, prefetch, load) and its nouns; ``radix``: the radix tree core (torch-free: the router's
  prefix tree stands on it too); ``radix_cache``: the pool-only prefix cache over it;
  ``tiered_cache``: the radix cache with the disk tier under it (``--kv-disk``).
- ``kv_blocks``: the one KV block format (keys, bytes, check, identity); ``disk_tier``: blocks in
  files; ``kv_transfer``: blocks between processes (prefill/decode disaggregation).

NOTE: this file imports nothing, so that ``tripod.memory.radix`` loads without torch.
"""
