"""Scale to zero end to end: a real ``tripod serve --min-replicas 0 --max-replicas 1`` fleet starts
with no replica, holds the first request (official ``openai`` client, streamed) while one starts,
answers it, reports the cold start in ``/fleet`` and ``/metrics``, and drains back to zero when idle."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.server_helpers import TripodProcess

pytestmark = pytest.mark.slow  # a replica's start-up (model load) is most of a minute on a busy CPU


class Fleet(TripodProcess):
    """``tripod serve`` as a scale-to-zero fleet: ready when its ``/fleet`` answers (its ``/health``
    is 503 while no replica is routable, by design of the router's health)."""

    def __init__(self, tmp: Path, *args: str) -> None:
        super().__init__(tmp, "serve", *args, "--replica-log-dir", str(tmp), wait_health=False)
        self.wait_for("the router to answer /fleet", lambda f: True, 60)

    def metric(self, name: str) -> float:
        text = httpx.get(self.url + "/metrics", timeout=5).text
        return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == name)


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    f = Fleet(tmp_path, "--min-replicas", "0", "--max-replicas", "1", "--slo-ttft-p95", "60000",
              "--lookback", "2", "--downscale-delay", "2", "--upscale-delay", "0", "--queue-timeout", "240",
              "--health-interval", "0.2", "--dtype", "float32", "--kv-cache-tokens", "4096", "--threads", "1")
    yield f
    assert f.stop() == 0, f.log()[-4000:]


def test_scale_to_zero_holds_the_first_request_and_reports_the_cold_start(fleet: Fleet) -> None:
    start = fleet.wait_for("the empty fleet", lambda f: f["active_replicas"] == 0, 10)
    assert start["replicas"] == [] and start["min_replicas"] == 0
    client = openai.OpenAI(base_url=fleet.url + "/v1", api_key="none", max_retries=0, timeout=300)
    stream = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "Say hello."}], max_tokens=8, temperature=0,
        stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text.strip(), fleet.log()[-4000:]
    f = fleet.wait_for("the cold start to be recorded", lambda f: f["cold_starts"] and f["held_requests"], 30)
    healthy_s = f["cold_starts"][0]["time_to_healthy_s"]
    held_ttft = f["held_requests"][0]["ttft_s"]
    assert 0 < healthy_s <= held_ttft  # the held request waited for the replica, then for its first token
    assert fleet.metric("tripod:fleet_cold_start_seconds") == pytest.approx(healthy_s, abs=1e-3)
    assert fleet.metric("tripod:router_held_requests_total") == 1
    assert "zero" in f["scale_events"][0]["reason"]
    # Idle past the look-back and the downscale delay: back to zero.
    f = fleet.wait_for("the fleet to drain to zero", lambda f: f["active_replicas"] == 0 and not f["replicas"], 120)
    assert [(e["from"], e["to"]) for e in f["scale_events"]] == [(0, 1), (1, 0)]
    assert "no traffic" in f["scale_events"][1]["reason"]
