"""Per-minute token limits are the fleet's, not each replica's: ``tripod serve --replicas 2
--tenants`` with round-robin routing, so that consecutive requests land on different replicas,
and every boundary checked exactly across both (``router/tenant_limits.py``): the prompt tokens
the replicas count, the output reserved at admission and refunded to what the answer used (a
whole answer's usage, a stream's tokens), ``max_context``, and the 429s in OpenAI's and
Anthropic's shapes naming the limit."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from tests.support.server_helpers import TripodProcess

pytestmark = pytest.mark.slow  # two real replicas: about 15 s (tests/router covers the limits)

TENANTS = """\
[[tenant]]
name = "acme"
keys = ["sk-acme"]
output_tokens_per_minute = 40

[[tenant]]
name = "beta"
keys = ["sk-beta"]
input_tokens_per_minute = 10

[[tenant]]
name = "gamma"
keys = ["sk-gamma"]
max_context = 8
"""
ARGS = ("--dtype", "float32", "--kv-cache-tokens", "4096", "--threads", "1")
CHAT = [{"role": "user", "content": "Hi"}]


def test_token_limits_hold_across_two_replicas(tmp_path: Path) -> None:
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(TENANTS)
    fleet = TripodProcess(tmp_path, "serve", "--replicas", "2", "--router-policy", "round_robin", "--tenants",
                          str(tenants), "--health-interval", "0.2", "--replica-log-dir", str(tmp_path), *ARGS)
    try:
        fleet.wait_for("both replicas", lambda f: all(r["state"] == "healthy" for r in f["replicas"]), 180)

        def client(key: str) -> openai.OpenAI:
            return openai.OpenAI(base_url=fleet.url + "/v1", api_key=key, max_retries=0, timeout=120)

        acme = client("sk-acme")
        # Output: reserved at admission (max_tokens), refunded to what each answer used.
        r1 = acme.chat.completions.with_raw_response.create(model="default", messages=CHAT, max_tokens=30)  # type: ignore[arg-type]
        used1 = r1.parse().usage.completion_tokens  # type: ignore[union-attr]
        left = 40 - used1
        stream = acme.chat.completions.with_raw_response.create(
            model="default", messages=CHAT, max_tokens=left, stream=True,  # type: ignore[arg-type]
            stream_options={"include_usage": True})
        chunks = list(stream.parse())
        used2 = next(c.usage.completion_tokens for c in chunks if c.usage is not None)
        assert {r1.headers["x-tripod-replica"], stream.headers["x-tripod-replica"]} == {"replica-0", "replica-1"}
        left -= used2
        # One token past what is left is refused (a replica alone would have admitted it)...
        with pytest.raises(openai.RateLimitError) as e:
            acme.chat.completions.create(model="default", messages=CHAT, max_tokens=left + 1)  # type: ignore[arg-type]
        assert e.value.response.json()["error"]["message"] == "tenant 'acme' is over its output_tokens_per_minute (40)"
        assert int(e.value.response.headers["retry-after"]) >= 1
        # ...and exactly what is left is admitted (unless nothing is).
        if left >= 1:
            r = acme.chat.completions.create(model="default", messages=CHAT, max_tokens=left,  # type: ignore[arg-type]
                                             extra_body={"ignore_eos": True})
            assert r.usage is not None and r.usage.completion_tokens == left
        with pytest.raises(openai.RateLimitError):
            acme.chat.completions.create(model="default", messages=CHAT, max_tokens=1)  # type: ignore[arg-type]
        msg = httpx.post(fleet.url + "/v1/messages", timeout=60, headers={"x-api-key": "sk-acme"},
                         json={"model": "default", "max_tokens": 1, "messages": CHAT})
        assert msg.status_code == 429 and int(msg.headers["retry-after"]) >= 1
        assert msg.json()["type"] == "error" and msg.json()["error"]["type"] == "rate_limit_error"
        assert "output_tokens_per_minute (40)" in msg.json()["error"]["message"]

        # Input: the prompt tokens a replica counts (token ids: exactly their number), on both replicas.
        beta = client("sk-beta")
        a = beta.completions.with_raw_response.create(model="default", prompt=[1, 2, 3, 4, 5, 6], max_tokens=1)
        b = beta.completions.with_raw_response.create(model="default", prompt=[7, 8, 9, 10], max_tokens=1)
        assert a.headers["x-tripod-replica"] != b.headers["x-tripod-replica"]
        with pytest.raises(openai.RateLimitError, match="input_tokens_per_minute"):
            beta.completions.create(model="default", prompt=[11], max_tokens=1)
        # A prompt larger than the whole budget can never fit: 400, not 429.
        with pytest.raises(openai.BadRequestError, match="input_tokens_per_minute"):
            beta.completions.create(model="default", prompt=list(range(1, 12)), max_tokens=1)

        # max_context: prompt + max_tokens, counted by the replica, refused by the router.
        gamma = client("sk-gamma")
        gamma.completions.create(model="default", prompt=[1, 2, 3, 4, 5], max_tokens=3)
        with pytest.raises(openai.BadRequestError) as bad:
            gamma.completions.create(model="default", prompt=[1, 2, 3, 4, 5, 6], max_tokens=3)
        assert bad.value.response.json()["error"]["code"] == "context_length_exceeded"
        # A malformed request is the replica's own 400, passed back.
        with pytest.raises(openai.BadRequestError):
            gamma.completions.create(model="default", prompt=[1], max_tokens=-1)

        page = httpx.get(fleet.url + "/metrics", timeout=10).text
        assert 'tripod:router_tenant_rejections_total{limit="output_tokens_per_minute",tenant="acme"} 3.0' in page
        assert 'tripod:router_tenant_rejections_total{limit="input_tokens_per_minute",tenant="beta"} 2.0' in page
        # The replicas attribute (per-tenant series) but neither refused anything, nor counted the router's counts.
        for rep in fleet.fleet()["replicas"]:
            text = httpx.get(rep["url"] + "/metrics", timeout=10).text
            assert "tripod:tenant_rejections_total{" not in text
        served = sum(float(line.rsplit(" ", 1)[1]) for rep in fleet.fleet()["replicas"]
                     for line in httpx.get(rep["url"] + "/metrics", timeout=10).text.splitlines()
                     if line.startswith('tripod:tenant_requests_total{status="200",tenant="beta"}'))
        assert served == 2
    finally:
        assert fleet.stop() == 0
