"""A model over two Ray nodes (``--parallel-backend ray``): a real two-node Ray cluster on this
machine (``ray start --head`` with no CPUs of its own, and a second node joined to it with one CPU,
both on loopback), a TP=2 and a PP=2 group whose worker Ray must place on the second node while rank 0
(this process, the driver) is on the head: the greedy tokens equal the single process's. A worker
actor killed leaves the engine unable to step (``WorkerLost``, no hang).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Greedy, check_greedy_tokens
from tests.engine.test_parallel import GREEDY, PROMPTS, SETTINGS
from tests.support.tiny_models import build_hf, save
from tripod import Engine
from tripod.engine.executor.group import WorkerLost
from tripod.fleet.process import free_port

pytestmark = pytest.mark.slow  # a local Ray cluster: about 35 s

ray = pytest.importorskip("ray")

RAY = str(Path(sys.executable).with_name("ray"))


def _wait_nodes(address: str, n: int, deadline: float) -> None:
    """Poll the cluster until ``n`` nodes are alive (start-up, not a race papered over)."""
    while time.monotonic() < deadline:
        out = subprocess.run([RAY, "status", "--address", address], capture_output=True, text=True, env=_env())
        if out.returncode == 0 and out.stdout.count("node_") >= n:
            return
        time.sleep(1.0)
    raise AssertionError(f"the Ray cluster at {address} never had {n} nodes")


def _env() -> dict[str, str]:
    # NOTE: a test cluster on loopback: no token (Ray 2.5x+ asks for one by default)
    return {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"}


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    """Two Ray nodes on loopback: a head with no CPUs and a worker node with one. Each ``ray start
    --block`` process is its node; terminating it stops the node (nothing else on the machine)."""
    port = free_port()
    address = f"127.0.0.1:{port}"
    tmp = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # short: Ray's socket paths have a length limit
    common = ["--block", "--node-ip-address", "127.0.0.1", "--disable-usage-stats", "--object-store-memory",
              str(200 << 20)]
    env = _env()
    old = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"  # this process joins as the driver
    head = subprocess.Popen([RAY, "start", "--head", "--port", str(port), "--num-cpus", "0",
                             "--include-dashboard", "false", "--temp-dir", tmp, *common],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True)
    nodes = [head]
    try:
        _wait_nodes(address, 1, time.monotonic() + 120)
        nodes.append(subprocess.Popen([RAY, "start", "--address", address, "--num-cpus", "1", *common],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                                      start_new_session=True))
        _wait_nodes(address, 2, time.monotonic() + 120)
        yield address
    finally:
        if ray.is_initialized():
            ray.shutdown()
        if old is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = old
        for p in reversed(nodes):
            os.killpg(p.pid, signal.SIGTERM)
        for p in nodes:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(p.pid, signal.SIGKILL)  # whatever of the node is left in its session
            except ProcessLookupError:
                pass
            p.wait()
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory, hf_tokenizer: Any) -> Path:
    return save(build_hf("llama"), tmp_path_factory.mktemp("llama"), hf_tokenizer)


@pytest.mark.parametrize("layout", ["tensor_parallel_size", "pipeline_parallel_size"])
def test_group_over_two_ray_nodes_equals_one_process(layout: str, cluster: str, llama: Path) -> None:
    single = Engine(model=str(llama), **SETTINGS)
    refs = [Greedy.from_tripod(single.generate([p], GREEDY)[0]) for p in PROMPTS]
    group = Engine(model=str(llama), **{layout: 2}, parallel_backend="ray", parallel_ray_address=cluster,
                   parallel_placement="spread", num_threads=1, **SETTINGS)
    try:
        workers = group.group
        assert workers is not None
        nodes = workers.nodes  # type: ignore[attr-defined]
        assert len(nodes) == 2 and nodes[0] != nodes[1], f"both ranks on one Ray node: {nodes}"
        card = group.runner.card()["parallel"]  # what /v1/models says: each rank's node
        assert [r.node for r in card.ranks] == nodes
        for i, out in enumerate(group.generate(PROMPTS, GREEDY)):
            check_greedy_tokens(out.token_ids, refs[i], f"{layout}=2 over two Ray nodes, prompt {i}")
        group.assert_consistent()
    finally:
        group.close()


def test_a_killed_ray_rank_stops_the_engine(cluster: str, llama: Path) -> None:
    group = Engine(model=str(llama), tensor_parallel_size=2, parallel_backend="ray", parallel_ray_address=cluster,
                   num_threads=1, parallel_timeout=20, **SETTINGS)
    try:
        group.generate([PROMPTS[1]], GREEDY)
        workers = group.group
        assert workers is not None
        ray.kill(workers.actors[0], no_restart=True)  # type: ignore[attr-defined]
        with pytest.raises((WorkerLost, RuntimeError)):
            for _ in range(50):  # the heartbeat's watch, then a step: either fails, neither hangs
                group.check_workers()
                group.generate([PROMPTS[1]], GREEDY)
    finally:
        group.close()
