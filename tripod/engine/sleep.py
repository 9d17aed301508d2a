"""Sleep: the KV pool's memory handed back to the OS while a trainer needs it, and taken back.

``PoolRelease`` owns the released state of one pool. It empties the storage of every tensor the
pool holds (``UntypedStorage.resize_(0)``): every view of it (the pool's row views, a backend's
per-layer views) stays the same object and sees the new memory after ``resize_`` back, so nothing
has to be rebuilt. On the CPU the allocator's large blocks are ``mmap``ed and go back with
``munmap``; ``malloc_trim`` returns whatever glibc kept in its heaps, so the process's resident
memory really drops (tested through ``tripod serve``). The memory comes back zeroed on wake; the
caller has flushed the prefix cache first (no KV survives a sleep).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from typing import Any

import torch

log = logging.getLogger(__name__)


def _trim() -> None:
    """Ask glibc to return free heap memory to the OS (a no-op where there is no glibc)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return
    try:
        ctypes.CDLL(name).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _storages(obj: Any) -> list[tuple[torch.UntypedStorage, int, torch.Tensor]]:
    """The distinct storages of the tensors ``obj`` holds as attributes (a view and its base once)."""
    seen: dict[int, tuple[torch.UntypedStorage, int, torch.Tensor]] = {}
    for value in vars(obj).values() if hasattr(obj, "__dict__") else ():
        if isinstance(value, torch.Tensor) and value.numel():
            st = value.untyped_storage()
            seen.setdefault(st.data_ptr(), (st, st.nbytes(), value))
    return list(seen.values())


class PoolRelease:
    """Owns whether one KV pool's memory is given back; ``release`` and ``restore`` are idempotent."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self._held: list[tuple[torch.UntypedStorage, int]] = []

    @property
    def released(self) -> bool:
        return bool(self._held)

    @property
    def nbytes(self) -> int:
        """What the pool holds now (0 while released)."""
        return sum(st.nbytes() for st, _, _ in _storages(self.pool))

    def refusal(self) -> str | None:
        """Why this pool cannot be released (None: it can)."""
        found = _storages(self.pool)
        if not found:
            return "this engine's KV pool holds no tensors it can release"
        if any(not st.resizable() for st, _, _ in found):
            return "this engine's KV pool lives in memory it cannot resize"
        return None

    def release(self) -> int:
        """Give the pool's memory back; returns the bytes released."""
        if self._held:
            return 0
        found = _storages(self.pool)
        total = 0
        for st, nbytes, _ in found:
            st.resize_(0)
            self._held.append((st, nbytes))
            total += nbytes
        _trim()
        log.info("KV pool released: %.1f MiB back to the OS", total / 2**20)
        return total

    def restore(self) -> None:
        """Take the pool's memory back, zeroed."""
        for st, nbytes in self._held:
            st.resize_(nbytes)
            torch.empty(0, dtype=torch.uint8, device=st.device).set_(st).zero_()  # (resize_ leaves it unset)
        self._held = []
