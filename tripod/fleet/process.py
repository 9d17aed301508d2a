"""Starting a ``tripod serve`` process and waiting for it: one piece of code for the fleet's
replicas, ``tripod bench --launch``, the benchmarks and the tests."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import IO

import httpx


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


SERVE = ("serve",)


def serve_command(host: str, port: int, serve_args: list[str], command: Sequence[str] = SERVE) -> list[str]:
    """The command line of ``tripod serve`` (or another tripod subcommand ``command`` that serves
    HTTP on ``--host``/``--port``) on ``host:port`` with the given options."""
    return [sys.executable, "-m", "tripod.cli", *command, "--host", host, "--port", str(port), *serve_args]


def _die_with_parent() -> None:
    # NOTE: runs in the child between fork and exec. A server must not outlive the process that
    # started it (a kill -9 of the supervisor would otherwise leave orphans holding ports).
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def spawn_serve(host: str, port: int, serve_args: list[str], log: IO[bytes] | int | None = None,
                command: Sequence[str] = SERVE) -> subprocess.Popen[bytes]:
    """Start ``tripod serve`` (or ``tripod <command>``) as a child that dies with this process."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen(
        serve_command(host, port, serve_args, command), stdout=log, stderr=subprocess.STDOUT if log is not None else None,
        env=env, preexec_fn=_die_with_parent,
    )


def wait_healthy(url: str, procs: Sequence[subprocess.Popen[bytes]], timeout: float) -> str | None:
    """Poll ``url``/health until it answers 200. None once healthy; otherwise why not (one of
    ``procs`` exited, or the time ran out)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                return f"exited with {p.returncode}"
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return None
        except httpx.HTTPError:
            pass
        time.sleep(0.2)  # a process coming up announces nothing else: poll, with a deadline
    return f"did not become healthy in {timeout:.0f} s"
