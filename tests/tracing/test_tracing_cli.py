"""Tracing through the CLI: ``tripod serve --replicas 1 --otel-file FILE`` (a router process and a
replica process, which gets the option forwarded) writes one trace per request into the file, the
router's and the replica's spans joined by ``traceparent``, the engine's under the replica's."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest

from tests.support.server_helpers import TripodProcess


@pytest.mark.slow
def test_a_fleet_writes_one_trace_per_request(tmp_path: Path) -> None:
    path = tmp_path / "spans.jsonl"
    fleet = TripodProcess(tmp_path, "serve", "--replicas", "1", "--otel-file", str(path), "--dtype", "float32",
                          "--kernels", "optimized", "--kv-cache-tokens", "8192", "--threads", "1",
                          "--replica-log-dir", str(tmp_path))
    try:
        client = openai.OpenAI(base_url=fleet.url + "/v1", api_key="none", max_retries=0, timeout=120)
        for i in range(2):
            answer = client.chat.completions.create(
                model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                extra_headers={"x-request-id": f"cli-{i}"})
            assert answer.choices[0].message.content is not None
    finally:
        assert fleet.stop() == 0  # NOTE: the processes flush their spans as they exit
    spans = [json.loads(line) for line in path.read_text().splitlines()]
    for i in range(2):
        roots = [s for s in spans if s["name"] == "router.request"
                 and s["attributes"].get("tripod.request_id") == f"cli-{i}"]
        assert len(roots) == 1
        trace = [s for s in spans if s["context"]["trace_id"] == roots[0]["context"]["trace_id"]]
        assert sorted(s["name"] for s in trace) == sorted(
            ["router.request", "router.attempt", "server.request", "engine.queue", "engine.prefill", "engine.decode"])
        by = {s["name"]: s for s in trace}
        assert by["router.request"]["resource"]["attributes"]["service.name"] == "tripod-router"
        assert by["server.request"]["resource"]["attributes"]["service.name"] == "tripod-server"
        assert by["server.request"]["parent_id"] == by["router.attempt"]["context"]["span_id"]
        assert by["server.request"]["attributes"]["tripod.request_id"] == f"cli-{i}"
        for name in ("engine.queue", "engine.prefill", "engine.decode"):
            assert by[name]["parent_id"] == by["server.request"]["context"]["span_id"]
