"""The Ray backend end to end: a local Ray instance, real ``tripod serve`` replicas inside actors.

One replica is launched, answers a chat completion, drains on ``terminate()`` and exits 0; a
second is launched and ``kill()``ed, after which it reports an exit code and its port is closed.
A replica no node can place fails to launch in time; without Ray the launcher says what to install.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tripod.fleet.ray_backend import RayLauncher, RayReplica

pytest.importorskip("ray")

SERVE_ARGS = ["--dtype", "float32", "--kv-cache-tokens", "4096", "--threads", "1"]
START_TIMEOUT = 180.0


@pytest.fixture(scope="module")
def launcher(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayLauncher]:
    logs = tmp_path_factory.mktemp("replica-logs")
    launcher = RayLauncher(SERVE_ARGS, address=None, num_cpus=1, log_dir=str(logs))
    try:
        yield launcher
    finally:
        launcher.close()


def wait_healthy(replica: RayReplica) -> dict[str, Any]:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        code = replica.exit_code()
        if code is not None:
            raise AssertionError(f"{replica.name} exited with {code}:\n{replica.log_tail()}")
        try:
            r = httpx.get(f"{replica.url}/health", timeout=2)
            if r.status_code == 200:
                return dict(r.json())
        except httpx.HTTPError:
            pass
        time.sleep(0.2)  # polling for start-up, not papering over a race
    log = replica.log_tail()
    replica.kill()
    raise AssertionError(f"{replica.name} did not become healthy in {START_TIMEOUT} s:\n{log}")


def port_closed(url: str) -> bool:
    try:
        httpx.get(f"{url}/health", timeout=2)
    except httpx.ConnectError:
        return True
    return False


@pytest.mark.slow  # the default run covers the Ray path end to end (test_fleet_e2e)
def test_launch_serve_terminate(launcher: RayLauncher) -> None:
    replica = launcher.launch(0)
    try:
        assert replica.name == "replica-0" and replica.actor_name.startswith("tripod-replica-0-")
        assert replica.url.startswith("http://") and replica.pid is not None
        assert replica.log_path.startswith(launcher.log_dir or "?")
        health = wait_healthy(replica)
        [desc] = launcher.describe()
        assert desc["name"] == replica.name and desc["url"] == replica.url and desc["pid"] == replica.pid

        r = httpx.post(f"{replica.url}/v1/chat/completions", timeout=60, json={
            "model": health["model"], "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
        })
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["message"]["content"].strip()
        usage = body["usage"]
        assert usage["prompt_tokens"] > 0 and 0 < usage["completion_tokens"] <= 8
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]

        replica.terminate()
        assert replica.wait(60) == 0, replica.log_tail()
        assert replica.exit_code() == 0
        assert port_closed(replica.url)
        assert "draining" in replica.log_tail()  # kept after the actor is gone
        assert launcher.describe() == []
    finally:
        replica.kill()


@pytest.mark.slow  # the default run covers the Ray path end to end (test_fleet_e2e)
def test_kill(launcher: RayLauncher) -> None:
    replica = launcher.launch(1)
    try:
        wait_healthy(replica)
        replica.kill()
        assert replica.wait(30) == -9  # SIGKILLed (an actor found dead also reads -9)
        assert replica.exit_code() == -9
        assert port_closed(replica.url)
        assert launcher.describe() == []
    finally:
        replica.kill()


@pytest.mark.slow  # the default run covers the Ray path end to end (test_fleet_e2e)
def test_unplaceable_replica_fails_to_launch(launcher: RayLauncher) -> None:
    # Shares the module's Ray instance (already initialised), which it must leave running.
    other = RayLauncher(SERVE_ARGS, resources={"tripod-test-nowhere": 1}, launch_timeout=3)
    with pytest.raises(RuntimeError, match="was not placed in 3 s"):
        other.launch(0)
    other.close()
    assert other.replicas == {}
    import ray

    assert ray.is_initialized()


def test_without_ray_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # makes ``import ray`` fail
    with pytest.raises(ValueError, match=r'pip install "tripod\[ray\]"'):
        RayLauncher(SERVE_ARGS)
