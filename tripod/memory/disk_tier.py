"""A disk tier under the KV pool: blocks of token KV rows in files, keyed by a token-prefix hash chain.

The unit is a *block* of ``kv_blocks`` (the one block format: ``block_tokens`` tokens of a prefix
with their rows of every layer, keyed by a hash chain from the *identity*, the caller's digest of
model, dtype and pool layout), so a different model or dtype has other keys and another directory
(``DIR/<identity>``) and never reads another's entries.

Files. ``DIR/<identity>/<kk>/<key>.kv``: the block's bytes (``kv_blocks``); ``<key>.st``: a hybrid
model's snapshot block (a state and the tail of tokens since the last whole block). A block is written to
``DIR/<identity>/tmp/`` and published by ``os.replace`` (atomic): a reader sees a whole file or
none. A torn or corrupted file (a crash of the disk, a file cut by hand) fails the header, size,
token or checksum check on read: it is counted, removed, and treated as absent, never served. Temp
files of dead writers are removed at start-up.

Threads. ``submit`` only queues (the caller has copied the rows out of the pool); a writer thread
checksums and writes. ``prefetch`` queues reads for a reader thread, which verifies the blocks into
a small staging area that ``read`` takes from first. Blocks queued but not yet written are served
from memory. The index (key → size, in LRU order) and the counters are guarded by one lock.

Capacity. The tier keeps the files it knows of under ``capacity_bytes``, removing the least
recently used first. A hit touches the file's mtime, so several engines on one directory (replicas
of one model on one host) share one recency order: each rescans the directory (by mtime) when
what it wrote since its last scan reaches an eighth of the capacity, so their files count too.
Concurrent writers of one block publish the same bytes; a reader whose file was removed meanwhile
sees a miss.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tripod.memory.kv_blocks import (
    TierLayout,
    block_format,
    block_parts,
    check_block,
    split_block,
)
from tripod.memory.tier_files import block_path, clean_tmp, scan_files

log = logging.getLogger(__name__)


@dataclass(slots=True)
class TierCounters:
    """Cumulative counts of one tier (this process's view)."""

    written_blocks: int = 0
    written_bytes: int = 0
    skipped_blocks: int = 0  # already on disk (written by this or another engine)
    dropped_blocks: int = 0  # not written: the write queue was full
    read_blocks: int = 0
    read_bytes: int = 0
    prefetched_blocks: int = 0
    corrupt_files: int = 0  # failed a check on read: removed, never served
    old_format_files: int = 0  # of them, an older block format's (written again when next saved)
    written_snapshots: int = 0  # snapshot blocks (hybrid models) among written_blocks
    read_snapshots: int = 0
    evicted_files: int = 0
    write_seconds: float = 0.0
    read_seconds: float = 0.0


@dataclass(slots=True)
class _Write:
    key: bytes
    tokens: list[int]
    rows: torch.Tensor  # [layers, block_tokens (a snapshot's tail), *row]: a copy, owned by the queue
    state: torch.Tensor | None = None  # a snapshot block's flat float32 state (a copy)
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.nbytes = self.rows.numel() * self.rows.element_size()
        if self.state is not None:
            self.nbytes += self.state.numel() * 4


class DiskTier:
    """Owns one identity's directory: the files, the index of them, the writer and reader threads."""

    def __init__(self, root: str | Path, capacity_bytes: int, layout: TierLayout, *,
                 max_pending_bytes: int = 512 << 20, max_staged_bytes: int = 256 << 20) -> None:
        if capacity_bytes < layout.file_bytes:
            raise ValueError(f"the disk tier's capacity ({capacity_bytes} bytes) holds not one block "
                             f"({layout.file_bytes} bytes)")
        self.root = Path(root)
        self.layout = layout
        self.capacity_bytes = capacity_bytes
        self.dir = self.root / layout.identity.hex()
        self.tmp = self.dir / "tmp"
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.max_pending_bytes = max_pending_bytes
        self.max_staged_bytes = max_staged_bytes
        self.counters = TierCounters()
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> file bytes, least recent first
        self._used = 0
        self._since_scan = 0  # bytes written since the last directory scan
        self._pending: dict[bytes, _Write] = {}  # queued, not yet published
        self._pending_bytes = 0
        self._staged: OrderedDict[bytes, torch.Tensor] = OrderedDict()  # prefetched, verified
        self._staged_bytes = 0
        self._reading: set[bytes] = set()
        self._snapshots: set[bytes] = set()  # keys of the index (or queue) that are snapshot blocks
        self._writes: queue.Queue[_Write | None] = queue.Queue()
        self._reads: queue.Queue[list[tuple[bytes, list[int]]] | None] = queue.Queue()
        self._idle = threading.Condition(self._lock)
        self._closed = False
        clean_tmp(self.tmp)
        self.rescan()
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk-writer", daemon=True)
        self._reader = threading.Thread(target=self._read_loop, name="kv-disk-reader", daemon=True)
        self._writer.start()
        self._reader.start()

    # ------------------------------------------------------------------ describing
    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def entries(self) -> int:
        return len(self._index)

    @property
    def pending_bytes(self) -> int:
        """Bytes of blocks queued and not yet published."""
        return self._pending_bytes

    @property
    def snapshot_entries(self) -> int:
        """Snapshot blocks on disk or queued, as far as this process knows."""
        return len(self._snapshots)

    def path(self, key: bytes, snapshot: bool | None = None) -> Path:
        return block_path(self.dir, key, key in self._snapshots if snapshot is None else snapshot)

    # ------------------------------------------------------------------ lookups
    def known(self, key: bytes) -> bool:
        """Whether ``key`` is on disk or queued for it, as far as this process knows (no syscall)."""
        with self._lock:
            return key in self._index or key in self._pending

    def count_present(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` are on disk or queued (another engine's new files count: a key
        this process does not know is looked for on disk)."""
        n = 0
        found = False
        for key in keys:
            if self.known(key):
                n += 1
                continue
            try:
                size = self.path(key).stat().st_size
            except OSError:
                break
            with self._lock:
                if key not in self._index:
                    self._index[key] = size
                    self._used += size
                    self._since_scan += size
                    found = True
            n += 1
        if found:
            # NOTE: files others published (a KV transfer's receiver, another engine) count against the
            # capacity here too: an engine that never writes (its evictions are on disk already) still
            # keeps the directory under it.
            self._enforce_capacity()
        return n

    def read(self, keys: Sequence[bytes], tokens: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """The blocks of ``keys`` (``tokens``: each block's token ids, checked against the file), in
        order, up to the first that is missing or fails a check."""
        out: list[torch.Tensor] = []
        for key, toks in zip(keys, tokens, strict=True):
            with self._idle:
                while key in self._reading:  # being prefetched: wait for it rather than read it twice
                    self._idle.wait()
                w = self._pending.get(key)
                staged = self._staged.pop(key, None)
                if staged is not None:
                    self._staged_bytes -= staged.numel() * staged.element_size()
            if w is not None:
                block: torch.Tensor | None = w.rows
            elif staged is not None:
                block = staged
                self._touch(key)
            else:
                loaded = self._load(key, toks)
                block = loaded if isinstance(loaded, torch.Tensor) else None
                if block is not None:
                    self._touch(key)
            if block is None:
                break
            out.append(block)
        return out

    def prefetch(self, keys: Sequence[bytes], tokens: Sequence[Sequence[int]]) -> None:
        """Read these blocks in the background (verified, staged for ``read``)."""
        todo = []
        with self._lock:
            for key, toks in zip(keys, tokens, strict=True):
                if key in self._staged or key in self._pending or key in self._reading:
                    continue
                self._reading.add(key)
                todo.append((key, list(toks)))
        if todo:
            self._reads.put(todo)

    def has_snapshot(self, key: bytes, *, probe: bool = False) -> bool:
        """Whether snapshot block ``key`` is on disk or queued as far as this process knows; ``probe``:
        look on disk too (a file another process published: a KV transfer's receiver)."""
        with self._lock:
            if key in self._snapshots:
                return True
        if not probe:
            return False
        try:
            size = self.path(key, True).stat().st_size
        except OSError:
            return False
        with self._lock:
            if key not in self._index:
                self._index[key] = size
                self._used += size
                self._since_scan += size
            self._snapshots.add(key)
        self._enforce_capacity()
        return True

    def read_snapshot(self, key: bytes, tail: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Snapshot block ``key`` (``tail``: its tokens, checked against the file): its tail's rows
        ``[layers, len(tail), *row]`` and its flat float32 state; None when absent or bad."""
        with self._lock:
            w = self._pending.get(key)
        if w is not None and w.state is not None:
            return w.rows, w.state
        got = self._load(key, tail, snapshot=True)
        if got is None:
            return None
        self._touch(key)
        rows, state = split_block(self.layout, got)
        assert state is not None
        with self._lock:
            self.counters.read_snapshots += 1
        return rows, state

    # ------------------------------------------------------------------ writes
    def has_room(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more of queued blocks would fit the write queue now."""
        return self._pending_bytes + nbytes <= self.max_pending_bytes

    def wait_for_room(self, nbytes: int, deadline: float) -> bool:
        """Wait (until ``time.monotonic()`` reaches ``deadline``) for the write queue to have room."""
        with self._idle:
            while self._pending and self._pending_bytes + nbytes > self.max_pending_bytes:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def count_dropped(self, blocks: int) -> None:
        """Count blocks the caller gave up on writing (the queue had no room)."""
        with self._lock:
            self.counters.dropped_blocks += blocks

    def submit(self, key: bytes, tokens: Sequence[int], rows: torch.Tensor, state: torch.Tensor | None = None) -> bool:
        """Queue one block (``rows``: a copy the tier may keep; with ``state``, a snapshot block whose
        ``tokens`` are its tail) for writing; False when it is known already or the queue is full
        (counted as dropped)."""
        if state is None:
            assert len(tokens) == self.layout.block_tokens and tuple(rows.shape) == self.layout.shape
        else:
            assert tuple(rows.shape) == self.layout.tail_shape(len(tokens))
        w = _Write(key, list(tokens), rows, state)
        with self._lock:
            if self._closed or key in self._index or key in self._pending:
                return False
            if self._pending and self._pending_bytes + w.nbytes > self.max_pending_bytes:
                self.counters.dropped_blocks += 1
                return False
            self._pending[key] = w
            if state is not None:
                self._snapshots.add(key)
            self._pending_bytes += w.nbytes
        self._writes.put(w)
        return True

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write is published (or ``timeout`` s pass); True when done."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._idle:
            while self._pending or self._reading:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def close(self, timeout: float | None = 10.0) -> bool:
        """Publish what is queued (up to ``timeout`` s), then stop the threads."""
        done = self.flush(timeout)
        with self._lock:
            self._closed = True
        self._writes.put(None)
        self._reads.put(None)
        self._writer.join(1.0)
        self._reader.join(1.0)
        return done

    def _write_loop(self) -> None:
        while True:
            w = self._writes.get()
            if w is None:
                return
            t0 = time.perf_counter()
            try:
                size = self._publish(w)
            except Exception as e:  # never leave a block marked pending: flush() waits on it
                log.warning("kv disk tier: writing a block failed (%s); it is not cached", e)
                size = None
            with self._lock:
                self.counters.write_seconds += time.perf_counter() - t0
                if size is not None and w.key not in self._index:
                    self._index[w.key] = size
                    self._used += size
                    self._since_scan += size
            self._enforce_capacity()
            with self._lock:
                del self._pending[w.key]
                if size is None and w.state is not None and w.key not in self._index:
                    self._snapshots.discard(w.key)
                self._pending_bytes -= w.nbytes
                self._idle.notify_all()

    def _publish(self, w: _Write) -> int | None:
        final = self.path(w.key, w.state is not None)
        if final.exists():  # another engine wrote it (the same bytes)
            with self._lock:
                self.counters.skipped_blocks += 1
            return final.stat().st_size
        # NOTE: layer by layer, each a contiguous run of the engine's copy: no torch op (and no
        # intra-op thread pool) on this thread.
        parts = block_parts(self.layout, w.key, w.tokens, w.rows, w.state)
        final.parent.mkdir(exist_ok=True)
        tmp = self.tmp / f"{w.key.hex()}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            with open(tmp, "wb") as f:
                for part in parts:
                    f.write(part)
            os.replace(tmp, final)  # atomic publish: readers see the whole file or none
        except BaseException:
            tmp.unlink(missing_ok=True)  # a full disk, say: leave no half-written file behind
            raise
        size = sum(len(p) if isinstance(p, bytes) else p.nbytes for p in parts)
        with self._lock:
            self.counters.written_blocks += 1
            self.counters.written_bytes += size
            if w.state is not None:
                self.counters.written_snapshots += 1
        return size

    # ------------------------------------------------------------------ reads
    def _read_loop(self) -> None:
        while True:
            todo = self._reads.get()
            if todo is None:
                return
            for key, toks in todo:
                try:
                    loaded = self._load(key, toks)
                    block = loaded if isinstance(loaded, torch.Tensor) else None
                except Exception:  # never leave a key marked in flight: read() waits on it
                    log.exception("kv disk tier: prefetching a block failed")
                    block = None
                with self._lock:
                    self._reading.discard(key)
                    if block is not None and key not in self._staged:
                        self._staged[key] = block
                        self._staged_bytes += block.numel() * block.element_size()
                        self.counters.prefetched_blocks += 1
                        while self._staged_bytes > self.max_staged_bytes:
                            _, old = self._staged.popitem(last=False)
                            self._staged_bytes -= old.numel() * old.element_size()
                    self._idle.notify_all()

    def _load(self, key: bytes, tokens: Sequence[int], *, snapshot: bool = False) -> torch.Tensor | bytearray | None:
        """One block from its file, verified (a KV block's rows; a snapshot block's bytes); None when
        absent, and (counted, removed) when bad."""
        path = self.path(key, snapshot)
        t0 = time.perf_counter()
        try:
            with open(path, "rb") as f:
                data = bytearray(f.read())
        except OSError:
            self._forget(key)
            return None
        why = check_block(self.layout, data, key, tokens, snapshot=snapshot)
        if why is not None:
            log.warning("kv disk tier: ignoring %s: %s", path.name, why)
            with self._lock:
                self.counters.corrupt_files += 1
                if block_format(data) is not None and data.startswith(b"TPKVBLK"):
                    self.counters.old_format_files += 1
            self._remove(key, snapshot)
            return None
        with self._lock:
            self.counters.read_blocks += 1
            self.counters.read_bytes += len(data)
            self.counters.read_seconds += time.perf_counter() - t0
        if snapshot:
            return data
        return split_block(self.layout, data)[0]

    # ------------------------------------------------------------------ the index, LRU
    def _touch(self, key: bytes) -> None:
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
        try:
            os.utime(self.path(key))  # recency shared with the other engines on this directory
        except OSError:
            pass

    def _forget(self, key: bytes) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self._used -= size
            if key not in self._pending:
                self._snapshots.discard(key)

    def _remove(self, key: bytes, snapshot: bool | None = None) -> None:
        path = self.path(key, snapshot)
        self._forget(key)
        try:
            path.unlink()
        except OSError:
            pass

    def _enforce_capacity(self) -> None:
        if self._since_scan * 8 >= self.capacity_bytes:
            self.rescan()
        while True:
            with self._lock:
                if self._used <= self.capacity_bytes or not self._index:
                    return
                key, size = self._index.popitem(last=False)
                self._used -= size
                self.counters.evicted_files += 1
                path = self.path(key)
                self._snapshots.discard(key)
            try:
                path.unlink()
            except OSError:
                pass

    def rescan(self) -> None:
        """Rebuild the index from the directory (every engine's files), least recently used first."""
        found, snapshots = scan_files(self.dir)
        with self._lock:
            self._snapshots = snapshots | {k for k, w in self._pending.items() if w.state is not None}
            self._index = OrderedDict((k, s) for _, k, s in found)
            self._used = sum(s for _, _, s in found)
            self._since_scan = 0
