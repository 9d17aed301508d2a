"""Scale to zero end to end: a real ``tripod serve --min-replicas 0 --max-replicas 1`` fleet starts
with no replica, holds the first request (official ``openai`` client, streamed) while one starts,
answers it, reports the cold start in ``/fleet`` and ``/metrics``, and drains back to zero when idle."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.server_helpers import free_port

pytestmark = pytest.mark.slow  # a replica's start-up (model load) is most of a minute on a busy CPU


class Fleet:
    """``tripod serve`` as a scale-to-zero fleet: ready when its ``/fleet`` answers (its ``/health``
    is 503 while no replica is routable, by design of the router's health)."""

    def __init__(self, tmp: Path, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / "fleet.log"
        self.tmp = tmp
        self._log = open(self.log_path, "w")  # closed in stop()
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRIPOD_API_KEY": ""}
        self.proc = subprocess.Popen([sys.executable, "-m", "tripod.cli", "serve", *args, "--port", str(self.port),
                                      "--replica-log-dir", str(tmp)], stdout=self._log, stderr=subprocess.STDOUT,
                                     env=env)
        self.wait("the router to answer /fleet", lambda f: True, 60)

    def fleet(self) -> dict[str, Any] | None:
        try:
            r = httpx.get(self.url + "/fleet", timeout=5)
        except httpx.TransportError:
            return None
        return dict(r.json()) if r.status_code == 200 else None

    def wait(self, what: str, cond: Any, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            f = self.fleet()
            if f is not None and cond(f):
                return f
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise AssertionError(f"timed out waiting for {what}: {f}\n{self.log()[-6000:]}")
            time.sleep(0.2)  # polling for a state, with a deadline

    def metric(self, name: str) -> float:
        text = httpx.get(self.url + "/metrics", timeout=5).text
        return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == name)

    def log(self) -> str:
        self._log.flush()
        text = self.log_path.read_text()
        for p in sorted(self.tmp.glob("replica-*.log")):
            text += f"\n--- {p.name} ---\n" + p.read_text()[-4000:]
        return text

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    f = Fleet(tmp_path, "--min-replicas", "0", "--max-replicas", "1", "--slo-ttft-p95", "60000",
              "--lookback", "2", "--downscale-delay", "2", "--upscale-delay", "0", "--queue-timeout", "240",
              "--health-interval", "0.2", "--dtype", "float32", "--kv-cache-tokens", "4096", "--threads", "1")
    yield f
    assert f.stop() == 0, f.log()[-4000:]


def test_scale_to_zero_holds_the_first_request_and_reports_the_cold_start(fleet: Fleet) -> None:
    start = fleet.wait("the empty fleet", lambda f: f["active_replicas"] == 0, 10)
    assert start["replicas"] == [] and start["min_replicas"] == 0
    client = openai.OpenAI(base_url=fleet.url + "/v1", api_key="none", max_retries=0, timeout=300)
    stream = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "Say hello."}], max_tokens=8, temperature=0,
        stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text.strip(), fleet.log()[-4000:]
    f = fleet.wait("the cold start to be recorded", lambda f: f["cold_starts"] and f["held_requests"], 30)
    healthy_s = f["cold_starts"][0]["time_to_healthy_s"]
    held_ttft = f["held_requests"][0]["ttft_s"]
    assert 0 < healthy_s <= held_ttft  # the held request waited for the replica, then for its first token
    assert fleet.metric("tripod:fleet_cold_start_seconds") == pytest.approx(healthy_s, abs=1e-3)
    assert fleet.metric("tripod:router_held_requests_total") == 1
    assert "zero" in f["scale_events"][0]["reason"]
    # Idle past the look-back and the downscale delay: back to zero.
    f = fleet.wait("the fleet to drain to zero", lambda f: f["active_replicas"] == 0 and not f["replicas"], 120)
    assert [(e["from"], e["to"]) for e in f["scale_events"]] == [(0, 1), (1, 0)]
    assert "no traffic" in f["scale_events"][1]["reason"]
