"""Start a real ``tripod serve`` process on 127.0.0.1 for end-to-end tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tripod.fleet import process as serve_process
from tripod.fleet.process import free_port

START_TIMEOUT = 180.0


def wait_healthy(p: Any, what: str, timeout: float) -> None:
    """Wait for ``p.url``/health; on exit or timeout, fail with ``p``'s log (and stop it)."""
    why = serve_process.wait_healthy(p.url, [p.proc], timeout)
    if why is not None:
        p.stop()
        raise RuntimeError(f"{what} {why}:\n{p.log()}")


class ServerProcess:
    """One ``tripod serve`` subprocess: started, waited for, stopped. Its log is kept in a file
    and shown when start-up fails.

    NOTE: float32 on tripod's kernels (``--kernels optimized``): the served path users get (in
    float32, so that answers equal the reference engine's), and about 2x faster than the float32
    reference path, which the engine-level parity tests cover."""

    def __init__(self, tmp: Path, *extra: str, api_key: str | None = None, own_group: bool = False) -> None:
        """``own_group``: the server leads a process group of its own (with its engine child in
        it), as under a service manager or a terminal's job control, so ``signal_group`` reaches both."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log_path = tmp / f"serve-{self.port}.log"
        args = [
            sys.executable, "-m", "tripod.cli", "serve", "--port", str(self.port), "--dtype", "float32", "--kernels", "optimized",
            "--kv-cache-tokens", "16384", "--threads", "2", *extra,
        ]
        if api_key:
            args += ["--api-key", api_key]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRIPOD_API_KEY": ""}
        self._log = open(self.log_path, "w")  # closed in stop()
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=own_group)
        self._wait_ready()

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def _wait_ready(self) -> None:
        wait_healthy(self, "tripod serve", START_TIMEOUT)

    def engine_stats(self) -> dict[str, Any]:
        r = httpx.get(f"{self.url}/debug/engine", headers=self.headers, timeout=30)
        r.raise_for_status()
        return dict(r.json())

    def wait_idle(self, timeout: float = 30.0) -> dict[str, Any]:
        """The engine's accounting once nothing is in flight (the server sees the engine's
        answers asynchronously, so poll until it settles)."""
        deadline = time.monotonic() + timeout
        while True:
            s = self.engine_stats()
            if s["running"] == 0 and s["waiting"] == 0 and s["inflight"] == 0:
                return s
            if time.monotonic() > deadline:
                raise AssertionError(f"the engine did not go idle: {s}")
            time.sleep(0.1)

    def wait_exit(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def signal_group(self, sig: int = signal.SIGTERM) -> None:
        """``sig`` to every process of the server's group (``own_group``): what systemd's default
        stop (``KillMode=control-group``) or Ctrl-C in a terminal does."""
        os.killpg(self.proc.pid, sig)

    def signal(self, sig: int = signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


class TripodProcess:
    """Any ``tripod`` command that serves HTTP on ``--port`` (a router, a fleet): started, waited for
    (``/health`` 200; ``wait_health=False``: not waited for, e.g. a fleet at zero replicas, whose
    ``/health`` is 503), stopped. Its log (and, for a fleet, its replicas' logs) is shown on failure."""

    def __init__(self, tmp: Path, *args: str, start_timeout: float = START_TIMEOUT, wait_health: bool = True) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.tmp = tmp
        self.log_path = tmp / f"tripod-{self.port}.log"
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRIPOD_API_KEY": ""}
        self._log = open(self.log_path, "w")  # closed in stop()
        cmd = [sys.executable, "-m", "tripod.cli", *args, "--port", str(self.port)]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        if wait_health:
            wait_healthy(self, f"tripod {args[0]}", start_timeout)

    def log(self) -> str:
        self._log.flush()
        text = self.log_path.read_text()
        for p in sorted(self.tmp.glob("replica-*.log")):
            text += f"\n--- {p.name} ---\n" + p.read_text()[-4000:]
        return text

    def fleet(self) -> dict[str, Any]:
        r = httpx.get(f"{self.url}/fleet", timeout=10)
        r.raise_for_status()
        return dict(r.json())

    def replica(self, name: str) -> dict[str, Any] | None:
        return next((r for r in self.fleet()["replicas"] if r["name"] == name), None)

    def wait_for(self, what: str, cond: Any, timeout: float) -> dict[str, Any]:
        """Poll /fleet until ``cond(fleet)`` holds (a router not listening yet is polled again)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                f: dict[str, Any] | None = self.fleet()
            except httpx.HTTPError:
                f = None
            if f is not None and cond(f):
                return f
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise AssertionError(f"timed out waiting for {what}: {f}\n{self.log()[-6000:]}")
            time.sleep(0.2)  # polling for a state, with a deadline

    def stop(self, timeout: float = 60) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode


def metric_sum(url: str, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` on ``url``'s /metrics whose labels include ``labels``."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def kernels_run() -> bool:
    """Whether ``--kernels optimized`` runs tripod's CPU kernels here (any x86-64 CPU with AVX2 and
    a compiler). Only they promise bit-identical numbers whatever the batch; torch's float32
    GEMMs sum in an order that depends on the batch shape (last digits of logprobs move)."""
    from tripod import kernels

    return kernels.unavailable_reason() is None


def assert_same_answer(got: Any, want: Any, path: str = "") -> None:
    """``got == want`` where the kernels run; elsewhere the same structure, tokens and text, with
    floats (logprobs) equal to 1e-4."""
    if kernels_run():
        assert got == want, path
        return
    if isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), path
        for k in want:
            assert_same_answer(got[k], want[k], f"{path}.{k}")
    elif isinstance(want, list | tuple):
        assert isinstance(got, list | tuple) and len(got) == len(want), path
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert_same_answer(a, b, f"{path}[{i}]")
    elif isinstance(want, float) and isinstance(got, float):
        assert abs(got - want) <= 1e-4, (path, got, want)
    else:
        assert got == want, path
