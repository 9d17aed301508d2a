"""Launching replicas: what a supervisor needs from "a running ``tripod serve`` somewhere".

A ``ReplicaLauncher`` starts one replica and returns a ``ReplicaProcess`` handle; the supervisor
then only asks the handle whether it has exited, and tells it to drain (SIGTERM) or die. Health is
never taken from the handle: it is probed over HTTP like any other replica. ``LocalLauncher`` runs
replicas as child processes of this one; ``tripod.fleet.ray_backend.RayLauncher`` runs them as
Ray actors anywhere in a Ray cluster.
"""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Protocol

from tripod.fleet.process import SERVE, free_port, spawn_serve


class ReplicaProcess(Protocol):
    """One launched replica. ``url`` is known as soon as it is launched (health comes later)."""

    name: str
    url: str
    pid: int | None  # of the ``tripod serve`` process, on whichever machine it runs

    def exit_code(self) -> int | None:
        """None while the replica process runs; its exit code once it has exited (non-blocking)."""
        ...

    def terminate(self) -> None:
        """Ask it to drain and exit (SIGTERM: in-flight requests finish, new ones are refused)."""
        ...

    def kill(self) -> None:
        """Stop it now (SIGKILL)."""
        ...

    def wait(self, timeout: float) -> int | None:
        """Block up to ``timeout`` s for it to exit; its exit code, or None if still running."""
        ...


class ReplicaLauncher(Protocol):
    """Starts replicas. When ``blocking``, ``launch`` may block and the supervisor calls it from a
    thread; otherwise it is called on the event loop."""

    blocking: bool

    def launch(self, index: int) -> ReplicaProcess: ...

    def close(self) -> None:
        """Release what the launcher holds (replicas are stopped by the supervisor first)."""
        ...


class LocalProcess:
    """A replica running as a child process of this one."""

    def __init__(self, name: str, host: str, port: int, proc: subprocess.Popen[bytes], log: IO[bytes] | None) -> None:
        self.name = name
        self.url = f"http://{host}:{port}"
        self.proc = proc
        self.pid: int | None = proc.pid
        self._log = log

    def exit_code(self) -> int | None:
        code = self.proc.poll()
        if code is not None and self._log is not None:
            self._log.close()
        return code

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()

    def wait(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None


class LocalLauncher:
    """Replicas as child processes on this machine, each on a free port of ``host``; their output
    goes to ``log_dir/replica-<index>.log`` when a folder is given, else to this process's.
    ``command``: the tripod subcommand each replica runs (``tripod serve``, or e.g. a chainlet's
    ``tripod chains worker``); it must serve ``/health`` on the ``--host``/``--port`` it is given."""

    # NOTE: launched from the event loop's thread, not a worker thread: PDEATHSIG fires when the
    # *thread* that forked the child exits, and a pool thread may exit long before this process.
    blocking = False

    def __init__(self, serve_args: list[str], host: str = "127.0.0.1", log_dir: Path | None = None,
                 command: Sequence[str] = SERVE) -> None:
        self.serve_args = serve_args
        self.host = host
        self.log_dir = log_dir
        self.command = tuple(command)

    def launch(self, index: int) -> LocalProcess:
        port = free_port(self.host)
        log = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            log = open(self.log_dir / f"replica-{index}.log", "ab")  # closed by LocalProcess on exit
        proc = spawn_serve(self.host, port, self.serve_args, log, self.command)
        return LocalProcess(f"replica-{index}", self.host, port, proc, log)

    def close(self) -> None:
        pass


class RoleLauncher:
    """Prefill/decode disaggregation (``--prefill-replicas P``): slots ``0 .. P-1`` run ``--role
    prefill``, the others ``--role decode`` (a relaunched slot keeps its role). The router learns
    each replica's role from its ``/health``."""

    blocking = False

    def __init__(self, serve_args: list[str], prefill: int, log_dir: Path | None = None) -> None:
        self.prefill = prefill
        self.prefill_launcher = LocalLauncher([*serve_args, "--role", "prefill"], log_dir=log_dir)
        self.decode_launcher = LocalLauncher([*serve_args, "--role", "decode"], log_dir=log_dir)

    def launch(self, index: int) -> LocalProcess:
        return (self.prefill_launcher if index < self.prefill else self.decode_launcher).launch(index)

    def close(self) -> None:
        pass
