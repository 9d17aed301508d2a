"""``tripod chains serve --backend ray``: every chainlet replica a Ray actor (on a local Ray
instance), found, called and restarted like the local processes. One test: Ray's start-up is slow."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.support.server_helpers import TripodProcess

APP = str(Path(__file__).parent / "chain_apps" / "basic.py")


@pytest.mark.slow
def test_chainlets_as_ray_actors(tmp_path: Path) -> None:
    pytest.importorskip("ray")
    p = TripodProcess(tmp_path, "chains", "serve", APP, "--backend", "ray", "--log-dir", str(tmp_path / "logs"),
                      start_timeout=180)
    try:
        deadline = time.monotonic() + 60
        while (graph := httpx.get(p.url + "/chain", timeout=10).json())["chainlets"]["Critic"]["replicas"]["routable"] < 2:
            assert time.monotonic() < deadline, graph
            time.sleep(0.2)  # NOTE: the chain is ready with one replica of each; waiting for the second
        assert graph["backend"] == "ray"
        assert all(r["url"].startswith("http://127.0.0.1:") for r in graph["chainlets"]["Critic"]["replicas"]["list"])
        r = httpx.post(p.url + "/run", json={"topic": "tides", "n": 2}, timeout=60)
        assert r.status_code == 200, r.text
        assert [v["score"] for v in r.json()] == [6, 12]
        # A replica killed mid-call: retried on the other, and its actor replaced.
        scratch = tmp_path / "scratch"
        scratch.mkdir()
        with httpx.Client(timeout=60) as client:
            import concurrent.futures

            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                fut = pool.submit(client.post, p.url + "/run",
                                  json={"topic": "tides", "n": 1, "hold_s": 1.5, "scratch": str(scratch)})
                deadline = time.monotonic() + 30
                while not (scratch / "Critic.pid").exists():
                    assert time.monotonic() < deadline
                    time.sleep(0.02)  # NOTE: written by the replica's process
                os.kill(int((scratch / "Critic.pid").read_text()), signal.SIGKILL)
                r = fut.result()
        assert r.status_code == 200, r.text
        deadline = time.monotonic() + 60
        while httpx.get(p.url + "/health", timeout=5).status_code != 200:
            assert time.monotonic() < deadline, p.log()[-3000:]
            time.sleep(0.2)  # NOTE: waiting for the replacement actor, bounded
    finally:
        assert p.stop(timeout=90) == 0, p.log()[-4000:]
