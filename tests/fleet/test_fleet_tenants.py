"""Tenants on a fleet (``tripod serve --replicas 1 --tenants``): the router checks keys and
enforces requests_per_second (429 with the limit named) and the token limits (with the replica's
counts), its replica gets the file with ``--tenant-limits none`` and attributes the tenant's
tokens, the router writes the audit log. Two replicas: ``test_fleet_token_limits.py``."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest

from tests.support.server_helpers import TripodProcess

pytestmark = pytest.mark.slow  # a real fleet: about 10 s

TENANTS = """\
[[tenant]]
name = "acme"
keys = ["sk-acme"]
output_tokens_per_minute = 10

[[tenant]]
name = "globex"
keys = ["sk-globex"]
requests_per_second = 0.01
"""
CHAT = [{"role": "user", "content": "Hi"}]


def test_a_fleet_with_tenants(tmp_path: Path) -> None:
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(TENANTS)
    audit = tmp_path / "audit.jsonl"
    fleet = TripodProcess(tmp_path, "serve", "--replicas", "1", "--tenants", str(tenants), "--audit-log", str(audit),
                          "--api-key", "sk-admin", "--threads", "2", "--replica-log-dir", str(tmp_path))
    try:
        def client(key: str) -> openai.OpenAI:
            return openai.OpenAI(base_url=fleet.url + "/v1", api_key=key, max_retries=0, timeout=120)

        client("sk-globex").chat.completions.create(model="default", messages=CHAT, max_tokens=2)  # type: ignore[arg-type]
        with pytest.raises(openai.RateLimitError) as e:
            client("sk-globex").chat.completions.create(model="default", messages=CHAT, max_tokens=2)  # type: ignore[arg-type]
        assert e.value.response.json()["error"]["message"] == "tenant 'globex' is over its requests_per_second (0.01)"
        # max_tokens alone over the output budget: refused by the router (400) with the replica's count.
        with pytest.raises(openai.BadRequestError, match="output_tokens_per_minute"):
            client("sk-acme").chat.completions.create(model="default", messages=CHAT, max_tokens=11)  # type: ignore[arg-type]
        r = client("sk-acme").chat.completions.create(model="default", messages=CHAT, max_tokens=3,  # type: ignore[arg-type]
                                                      extra_body={"ignore_eos": True})
        assert r.usage is not None and r.usage.completion_tokens == 3
        with pytest.raises(openai.AuthenticationError):
            client("sk-nobody").chat.completions.create(model="default", messages=CHAT, max_tokens=1)  # type: ignore[arg-type]
        replica = fleet.fleet()["replicas"][0]["url"]
        page = httpx.get(replica + "/metrics", timeout=10).text
        assert 'tripod:tenant_output_tokens_total{tenant="acme"} 3.0' in page
        assert 'tripod:tenant_requests_total{status="429",tenant="globex"}' not in page  # the router refused it
        router_page = httpx.get(fleet.url + "/metrics", timeout=10).text
        assert 'tripod:router_tenant_rejections_total{limit="requests_per_second",tenant="globex"} 1.0' in router_page
    finally:
        assert fleet.stop() == 0
    rows = [json.loads(x) for x in audit.read_text().splitlines()]
    assert [(x["tenant"], x["status"]) for x in rows] == [("globex", 200), ("globex", 429), ("acme", 400),
                                                          ("acme", 200)]
    assert rows[-1]["output_tokens"] == 3 and "sk-" not in audit.read_text()
