"""The disk tier's files on their own: where a block lives, what a directory holds, dead temp files.

``DIR/<identity>/<kk>/<key>.kv`` is a KV block, ``<key>.st`` a hybrid model's snapshot block
(``kv_blocks``); temp files are ``DIR/<identity>/tmp/<key>.<pid>.<thread>.tmp`` until ``os.replace``
publishes them. Used by the tier (``disk_tier``) and by a KV transfer's receiver (``kv_transfer``),
which publish into the same layout.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from tripod.memory.kv_blocks import KEY_BYTES

STALE_TMP_SECONDS = 600.0  # a temp file this old whose writer cannot be told alive is removed


def block_path(directory: Path, key: bytes, snapshot: bool = False) -> Path:
    """Where block ``key`` (``snapshot``: a snapshot block) lives under a tier's ``DIR/<identity>``."""
    h = key.hex()
    return directory / h[:2] / f"{h}.{'st' if snapshot else 'kv'}"


def scan_files(directory: Path) -> tuple[list[tuple[float, bytes, int]], set[bytes]]:
    """Every block file under ``directory`` as (mtime, key, size), least recently used first, and
    the keys of the snapshot blocks among them."""
    found: list[tuple[float, bytes, int]] = []
    snapshots: set[bytes] = set()
    for sub in directory.iterdir() if directory.exists() else ():
        if not sub.is_dir() or len(sub.name) != 2:
            continue
        for entry in os.scandir(sub):
            name = entry.name
            if name[-3:] not in (".kv", ".st") or len(name) != 2 * KEY_BYTES + 3:
                continue
            try:
                st = entry.stat()
                key = bytes.fromhex(name[:-3])
            except (OSError, ValueError):
                continue
            found.append((st.st_mtime, key, st.st_size))
            if name.endswith(".st"):
                snapshots.add(key)
    found.sort(key=lambda x: x[0])
    return found, snapshots


def clean_tmp(tmp: Path) -> None:
    """Remove temp files left by writers that died mid-write (never published, never read)."""
    now = time.time()
    for entry in os.scandir(tmp):
        parts = entry.name.split(".")
        pid = int(parts[1]) if len(parts) == 4 and parts[1].isdigit() else None
        try:
            stale = now - entry.stat().st_mtime > STALE_TMP_SECONDS
        except OSError:
            continue
        if stale or (pid is not None and not _alive(pid)):
            try:
                os.unlink(entry.path)
            except OSError:
                pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
