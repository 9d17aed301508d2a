"""The engine's LoRA adapters: registered by name, at most ``max_loras`` resident, LRU.

- ``register(name, path)`` reads and checks the PEFT folder against the base model at once (a bad
  adapter is refused with the reason, before any request uses it); it stays resident while there
  is room. ``unregister(name)`` refuses new requests for it at once; the running ones finish on
  the weights they hold (``in_use`` says how many).
- A request takes its adapter when it is admitted into the running batch (``acquire``: made
  resident if it was evicted, evicting the least recently used adapter no running request holds)
  and gives it back when it leaves (``release``). When every resident adapter is held and another
  is needed, the request waits in the queue.
- A request names its adapter once: admission resolves the name into a ``LoraHandle`` (name,
  files' digest, cache namespace), and everything after (the scheduler's acquire and release,
  prompt scoring, the cache key) goes by the handle. An adapter unloaded or replaced under its
  name while a request waits makes the handle stale (``current``): the request is refused rather
  than run on other weights.
- Prefix-cache namespaces: each distinct adapter content (its files' digest) gets a number; a
  request's tokens are keyed into the radix tree under it (``memory.prefix_cache.namespaced_key``),
  so a base prefix is never reused for an adapter's request, nor one adapter's for another's. The
  same files loaded again (any name) get the same number, and their cached prefixes stay valid.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tripod.layers.lora import LoraAdapter, LoraError, LoraPool, adapter_digest, read_peft
from tripod.memory.prefix_cache import MAX_NAMESPACES, NAMESPACE_STRIDE
from tripod.models.config import ModelConfig


@dataclass(frozen=True, slots=True)
class LoraHandle:
    """A request's adapter as admission resolved it: by name, its files' digest and the prefix
    cache's namespace for that content."""

    name: str
    digest: str
    namespace: int


class LoraRegistry:
    """Owns the engine's adapters: their paths and digests by name, the resident ones (at most
    ``max_loras``, in the float32 ``pool``), which running requests hold which, and the cache
    namespaces (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, *, max_loras: int, max_rank: int,
                 dense_layers: set[int]) -> None:
        if cfg.vocab_size >= NAMESPACE_STRIDE:
            raise ValueError(f"LoRA: a vocabulary of {cfg.vocab_size} tokens is over the cache namespaces' stride")
        self.cfg, self.dtype, self.device = cfg, dtype, device
        self.max_loras, self.max_rank, self.dense_layers = max_loras, max_rank, dense_layers
        self.paths: dict[str, str] = {}
        self.digests: dict[str, str] = {}
        self.resident: OrderedDict[str, LoraAdapter] = OrderedDict()  # least recently used first
        self.held: dict[str, int] = {}  # name -> running requests holding it
        self.namespaces: dict[str, int] = {}  # digest -> namespace
        self.loads = 0
        # NOTE: adapters are kept and applied in float32 whatever the model's dtype: their matmuls are
        # small, where CPU float32 kernels are several times faster than bfloat16's (and exact).
        self.pool = LoraPool(max_loras, cfg, torch.float32, device)  # the resident adapters' weights, stacked
        self._free_slots = list(range(max_loras))

    # ------------------------------------------------------------------ registration
    def register(self, name: str, path: str) -> LoraAdapter:
        if not name or name in self.paths:
            raise LoraError(f"a LoRA adapter named {name!r} is already loaded" if name else "a LoRA adapter needs a name")
        if self.held.get(name):  # unloaded, its last requests still running on it
            raise LoraError(f"the LoRA adapter {name!r} just unloaded still has {self.held[name]} running requests; "
                            "load it again once they finish")
        adapter = self._read(name, path)
        if adapter.digest not in self.namespaces:
            if len(self.namespaces) >= MAX_NAMESPACES:
                raise LoraError(f"this engine has seen {MAX_NAMESPACES} distinct adapters; restart it to load more")
            self.namespaces[adapter.digest] = len(self.namespaces) + 1
        self.paths[name] = str(path)
        self.digests[name] = adapter.digest
        if self._room():
            self._make_resident(name, adapter)
        return adapter

    def unregister(self, name: str) -> None:
        if name not in self.paths:
            raise LoraError(f"no LoRA adapter named {name!r} is loaded")
        del self.paths[name]
        del self.digests[name]
        if not self.held.get(name):
            self._evict(name)

    def resolve(self, name: str) -> LoraHandle:
        """The handle of the adapter loaded as ``name`` now (a request's, for its whole life)."""
        if name not in self.paths:
            raise LoraError(f"no LoRA adapter named {name!r} is loaded (loaded: {', '.join(self.paths) or 'none'})")
        digest = self.digests[name]
        return LoraHandle(name, digest, self.namespaces[digest])

    def current(self, handle: LoraHandle) -> bool:
        """Whether ``handle``'s adapter is still the one loaded under its name."""
        return self.digests.get(handle.name) == handle.digest

    def in_use(self, name: str) -> int:
        return self.held.get(name, 0)

    @property
    def free_places(self) -> int:
        """Places in the pool no resident adapter takes."""
        return len(self._free_slots)

    # ------------------------------------------------------------------ requests
    def acquire(self, handle: LoraHandle) -> LoraAdapter | None:
        """The adapter for a request entering the batch (held until ``release``); None when it
        cannot be made resident now (every resident adapter is held). The handle is ``current``
        (the scheduler checks it first)."""
        name = handle.name
        adapter = self.resident.get(name)
        if adapter is None:
            if name not in self.paths:
                raise LoraError(f"no LoRA adapter named {name!r} is loaded")
            if not self._room():
                return None
            adapter = self._make_resident(name, self._read(name, self.paths[name]))
        self.resident.move_to_end(name)
        self.held[name] = self.held.get(name, 0) + 1
        return adapter

    def weights(self, handle: LoraHandle) -> LoraAdapter:
        """The adapter's weights for a pass outside the steps (prompt scoring): the resident copy,
        or one read now (not made resident)."""
        name = handle.name
        if not self.current(handle):
            raise LoraError(f"the LoRA adapter {name!r} was unloaded or replaced; send the request again")
        adapter = self.resident.get(name)
        return adapter if adapter is not None else self._read(name, self.paths[name])

    def release(self, handle: LoraHandle) -> None:
        name = handle.name
        left = self.held.get(name, 0) - 1
        if left > 0:
            self.held[name] = left
            return
        self.held.pop(name, None)
        if name not in self.paths:  # unloaded while running: its weights go with its last request
            self._evict(name)

    # ------------------------------------------------------------------ internals
    def _room(self) -> bool:
        """Whether one more adapter can be resident (evicting an unheld one if needed)."""
        if len(self.resident) < self.max_loras:
            return True
        for name in self.resident:
            if not self.held.get(name):
                self._evict(name)
                return True
        return False

    def _make_resident(self, name: str, adapter: LoraAdapter) -> LoraAdapter:
        adapter.slot = min(self._free_slots)  # lowest first: a step reads the pool only up to its highest slot
        self._free_slots.remove(adapter.slot)
        self.pool.put(adapter.slot, adapter)
        self.resident[name] = adapter
        return adapter

    def _evict(self, name: str) -> None:
        adapter = self.resident.pop(name, None)
        if adapter is not None and adapter.slot is not None:
            self._free_slots.append(adapter.slot)
            adapter.slot = None

    def _read(self, name: str, path: str) -> LoraAdapter:
        if not Path(path).is_dir():
            raise LoraError(f"LoRA adapter {name!r}: {path} is not a directory")
        if name in self.digests and adapter_digest(path) != self.digests[name]:
            raise LoraError(f"LoRA adapter {name!r}: its files at {path} changed since it was loaded; unload and load it again")
        self.loads += 1
        return read_peft(name, path, self.cfg, max_rank=self.max_rank, dtype=torch.float32, device=self.device,
                         dense_layers=self.dense_layers)

    def describe(self) -> list[dict[str, Any]]:
        return [{"name": n, "path": p, "resident": n in self.resident, "running": self.held.get(n, 0)}
                for n, p in self.paths.items()]
