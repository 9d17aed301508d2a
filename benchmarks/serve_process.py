"""``tripod serve`` (a server or a fleet) as a subprocess on a free port for the benchmarks, its
log in a file; ready once ``ready_path`` answers 2xx (a fleet at zero replicas has /health 503, so
fleets wait on /fleet)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


class ServeProcess:
    def __init__(self, tmp: Path, args: list[str], ready_path: str = "/health", name: str = "serve",
                 stop_timeout: float = 60.0) -> None:
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        self.port = s.getsockname()[1]
        s.close()
        self.url = f"http://127.0.0.1:{self.port}"
        self.stop_timeout = stop_timeout
        self.log = open(tmp / f"{name}-{self.port}.log", "w")  # closed in stop()
        self.proc = subprocess.Popen([sys.executable, "-m", "tripod.cli", "serve", "--port", str(self.port), *args],
                                     stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, "TRIPOD_API_KEY": ""})
        deadline = time.monotonic() + 300
        while True:
            try:
                httpx.get(self.url + ready_path, timeout=2).raise_for_status()
                break
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"tripod serve did not start; see {self.log.name}")
            time.sleep(0.5)  # polling for start-up

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(self.stop_timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()
