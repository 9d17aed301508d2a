"""A fleet of tensor-parallel groups (``tripod serve --replicas 2 --tensor-parallel-size 2``): a
worker of the group serving an answer is killed with SIGKILL mid-stream; its engine fails, and the
router continues the answer on the other group, token for token the undisturbed answer."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.router.test_failover_e2e import metric
from tests.server.test_tensor_parallel_serve import workers_of
from tests.support.server_helpers import TripodProcess
from tests.support.tiny_models import build_hf, save

CUT_AFTER = 5


@pytest.mark.slow
def test_a_killed_worker_is_a_failed_replica_and_the_answer_continues(tmp_path: Path, hf_tokenizer: Any) -> None:
    folder = save(build_hf("llama"), tmp_path / "llama", hf_tokenizer)
    fleet = TripodProcess(tmp_path, "serve", "--model", str(folder), "--replicas", "2", "--tensor-parallel-size", "2",
                          "--dtype", "float32", "--kernels", "eager", "--parallel-timeout", "10",
                          "--kv-cache-tokens", "2048", "--health-interval", "0.2", "--max-retries", "2",
                          "--replica-log-dir", str(tmp_path), start_timeout=300)
    try:
        fleet.wait_for("2 healthy replicas", lambda f: sum(r["state"] == "healthy" for r in f["replicas"]) >= 2, 300)
        client = openai.OpenAI(base_url=fleet.url + "/v1", api_key="none", max_retries=0, timeout=180)
        kw: dict[str, Any] = dict(model="llama", prompt=list(range(5, 45)), max_tokens=60, temperature=0, stream=True,
                                  extra_body={"ignore_eos": True})
        want = "".join(c.choices[0].text for c in client.completions.create(**kw))
        continued = metric(fleet, "tripod:router_continuations_total", outcome="ok")
        raw = client.completions.with_raw_response.create(**kw)
        serving = raw.headers["x-tripod-replica"]
        got = ""
        for n, chunk in enumerate(raw.parse(), 1):
            got += chunk.choices[0].text if chunk.choices else ""
            if n == CUT_AFTER:
                rep = next(r for r in fleet.fleet()["replicas"] if r["name"] == serving)
                engine = httpx.get(rep["url"] + "/health", timeout=10).json()["engine_pid"]
                (worker,) = workers_of(engine)
                os.kill(worker, signal.SIGKILL)
        assert got == want, "the continued answer differs from the undisturbed one"
        assert metric(fleet, "tripod:router_continuations_total", outcome="ok") == continued + 1, \
            "the answer was not continued on the other group"
    finally:
        fleet.stop()
