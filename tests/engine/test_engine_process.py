"""The engine process's heartbeats (``python -m tripod.engine.process``), spoken to over its ZMQ
pipes as the HTTP process does: the step that leaves the loop idle is followed by a heartbeat that
says so at once, not a ``heartbeat_interval`` later. Routers place requests by the running and
waiting counts a server's ``/metrics`` takes from these heartbeats; a stale "running: 1" after the
last answer sent a router's next request to another region (tests/fleet/test_regions_e2e.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import zmq

from tripod import SamplingParams
from tripod.config import EngineConfig
from tripod.protocol import engine_ipc

# Far longer than the test may wait: only the heartbeat sent on going idle can arrive in time.
INTERVAL = 3600.0


def _next(pull: zmq.Socket, deadline: float) -> Any:
    while time.monotonic() < deadline:
        if pull.poll(1000):
            return engine_ipc.decode(pull.recv())
    raise AssertionError("the engine process went quiet")


@pytest.mark.slow  # (moved out of the default run: CI runs it)
def test_going_idle_is_reported_at_once(base_engine: Any, tmp_path: Path) -> None:
    cfg = EngineConfig(model=base_engine.config.model, dtype="float32", kv_cache_tokens=1024, max_running=4)
    ctx = zmq.Context()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    push.bind(f"ipc://{tmp_path}/to-engine")
    pull.bind(f"ipc://{tmp_path}/from-engine")
    launch = engine_ipc.EngineLaunch(engine_config=cfg, to_engine=f"ipc://{tmp_path}/to-engine",
                                     from_engine=f"ipc://{tmp_path}/from-engine", heartbeat_interval=INTERVAL,
                                     log_level=30, parent_pid=os.getpid())
    proc = subprocess.Popen([sys.executable, "-m", "tripod.engine.process", engine_ipc.encode_launch(launch)])
    try:
        deadline = time.monotonic() + 180
        assert isinstance(_next(pull, deadline), engine_ipc.Ready)
        ids = base_engine.tokenizer.encode("The lighthouse keeper")
        for round_ in range(2):  # twice: every return to idle, not only the first
            params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
            push.send(engine_ipc.encode(engine_ipc.AddRequest(f"r{round_}", ids, params)))
            tokens, ended = 0, False
            while not ended:
                msg = _next(pull, deadline)
                if isinstance(msg, engine_ipc.Outputs):
                    for out in msg.items:
                        tokens += len(out.token_ids)
                        ended = ended or out.finish_reason is not None
            assert tokens == 5
            after = _next(pull, deadline)
            assert isinstance(after, engine_ipc.Heartbeat), after
            assert after.stats.running == after.stats.waiting == 0
        push.send(engine_ipc.encode(engine_ipc.Shutdown()))
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        push.close(0)
        pull.close(0)
        ctx.term()
