"""The router's tenants over real HTTP (stub replicas): keys → tenants (401 for an unknown one, in
each API's shape), its limits (requests_per_second, max_concurrent, models) answered 429/404 with
``Retry-After`` and the limit named, through the official clients; per-tenant series; the audit
log; a live reload that rotates a key."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.router.stubs import CHAT, MODEL, RouterServer, Stub, wait_for

TENANTS = f"""\
[[tenant]]
name = "acme"
keys = ["sk-acme"]
max_concurrent = 1

[[tenant]]
name = "globex"
keys = ["sk-globex"]
requests_per_second = 0.01   # one per 100 s: the second is refused however slow the test runs

[[tenant]]
name = "initech"
keys = ["sk-initech"]
models = ["another-model"]

[[tenant]]
name = "open"
keys = ["sk-open"]
models = ["{MODEL}"]
"""


@pytest.fixture
def setup(tmp_path: Path, make_stub: Callable[[str], Stub],
          make_router: Callable[..., RouterServer]) -> tuple[RouterServer, Stub, Path, Path]:
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(TENANTS)
    audit = tmp_path / "audit.jsonl"
    stub = make_stub("a")
    rs = make_router([stub], tenants=str(tenants), audit_log=str(audit), api_key="sk-admin")
    return rs, stub, tenants, audit


def oai(rs: RouterServer, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=rs.url + "/v1", api_key=key, max_retries=0, timeout=10)


def test_keys_limits_metrics_and_audit(setup: tuple[RouterServer, Stub, Path, Path]) -> None:
    rs, _, _, audit = setup
    r = oai(rs, "sk-open").chat.completions.create(model=MODEL, messages=CHAT)  # type: ignore[arg-type]
    assert r.choices[0].message.content
    oai(rs, "sk-admin").chat.completions.create(model=MODEL, messages=CHAT)  # type: ignore[arg-type]
    with pytest.raises(openai.AuthenticationError) as e401:
        oai(rs, "sk-nobody").chat.completions.create(model=MODEL, messages=CHAT)  # type: ignore[arg-type]
    assert e401.value.status_code == 401 and "not valid" in e401.value.message
    with pytest.raises(anthropic.AuthenticationError) as a401:
        anthropic.Anthropic(base_url=rs.url, api_key="sk-nobody", max_retries=0).messages.create(
            model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    assert a401.value.body["type"] == "error"  # type: ignore[index]
    # models: a model the tenant may not use is not found (OpenAI's shape).
    with pytest.raises(openai.NotFoundError) as e404:
        oai(rs, "sk-initech").chat.completions.create(model=MODEL, messages=CHAT)  # type: ignore[arg-type]
    assert "may not use the model" in e404.value.message
    # requests_per_second: the second request in the window is refused, with the wait until the first leaves it.
    oai(rs, "sk-globex").chat.completions.create(model=MODEL, messages=CHAT)  # type: ignore[arg-type]
    with pytest.raises(anthropic.RateLimitError) as e429:
        anthropic.Anthropic(base_url=rs.url, api_key="sk-globex", max_retries=0).messages.create(
            model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    body: Any = e429.value.body
    assert body["type"] == "error" and body["error"]["type"] == "rate_limit_error"
    assert body["error"]["message"] == "tenant 'globex' is over its requests_per_second (0.01)"
    assert 90 <= int(e429.value.response.headers["retry-after"]) <= 100
    # Per-tenant series.
    assert rs.metric("tripod:router_tenant_requests_total", tenant="open", status="200") == 1
    assert rs.metric("tripod:router_tenant_requests_total", tenant="default", status="200") == 1
    assert rs.metric("tripod:router_tenant_requests_total", tenant="globex", status="429") == 1
    assert rs.metric("tripod:router_tenant_rejections_total", tenant="globex", limit="requests_per_second") == 1
    assert rs.metric("tripod:router_tenant_rejections_total", tenant="initech", limit="models") == 1
    assert rs.metric("tripod:router_tenant_prompt_tokens_total", tenant="open") == 1  # the stub's usage: "Say hi." in 4-char tokens
    assert rs.metric("tripod:router_tenant_output_tokens_total", tenant="open") == 3
    assert rs.metric("tripod:router_tenant_time_to_first_token_seconds_count", tenant="open") == 1
    # The audit log: one line per authenticated request (the unknown key's is not), no key, no prompt.
    lines = wait_for(lambda: _lines(audit, 5), "5 audit lines")
    assert [(x["tenant"], x["status"]) for x in lines] == [
        ("open", 200), ("default", 200), ("initech", 404), ("globex", 200), ("globex", 429)]
    assert lines[0]["key_id"] == hashlib.sha256(b"sk-open").hexdigest()[:12]
    assert lines[0]["route"] == "/v1/chat/completions" and lines[0]["model"] == MODEL
    assert (lines[0]["prompt_tokens"], lines[0]["output_tokens"]) == (1, 3)
    text = audit.read_text()
    assert "sk-" not in text and "Say hi" not in text and "prompt" not in json.loads(text.splitlines()[0])


def _lines(path: Path, n: int) -> list[dict[str, Any]] | None:
    if not path.exists():
        return None
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    return lines if len(lines) >= n else None


def test_max_concurrent_and_a_live_key_rotation(setup: tuple[RouterServer, Stub, Path, Path]) -> None:
    rs, stub, tenants, _ = setup
    stub.mode = "hold"
    held: list[Any] = []
    t = threading.Thread(target=lambda: held.append(oai(rs, "sk-acme").chat.completions.create(
        model=MODEL, messages=CHAT)))  # type: ignore[arg-type]
    t.start()
    wait_for(lambda: stub.active == 1, "the first request held at the replica")
    with pytest.raises(openai.RateLimitError) as e:
        oai(rs, "sk-acme").chat.completions.create(model=MODEL, messages=CHAT)  # type: ignore[arg-type]
    assert e.value.response.json()["error"]["message"] == "tenant 'acme' is over its max_concurrent (1)"
    assert e.value.response.headers["retry-after"] == "1"
    stub.release.set()
    t.join(10)
    assert held
    stub.mode = "ok"
    oai(rs, "sk-acme").chat.completions.create(model=MODEL, messages=CHAT)  # type: ignore[arg-type]  # freed
    # Rotation: the file changes (polled), the new key works and the old one is refused at once.
    before = rs.metric("tripod:router_tenant_file_reloads_total", result="ok")
    tenants.write_text(TENANTS.replace('keys = ["sk-acme"]', 'keys = ["sk-acme-2"]'))
    os.utime(tenants, ns=(1, 1))
    wait_for(lambda: rs.metric("tripod:router_tenant_file_reloads_total", result="ok") > before, "the reload")
    assert httpx.post(rs.url + "/v1/chat/completions", json={"model": MODEL, "messages": CHAT},
                      headers={"Authorization": "Bearer sk-acme"}).status_code == 401
    oai(rs, "sk-acme-2").chat.completions.create(model=MODEL, messages=CHAT)  # type: ignore[arg-type]
    # An invalid file: kept out, the last good one serving.
    tenants.write_text(TENANTS + "\n[[tenant]]\nname = \"acme\"\nkeys = [\"x\"]\n")
    wait_for(lambda: rs.metric("tripod:router_tenant_file_reloads_total", result="kept") >= 1, "the refusal")
    oai(rs, "sk-acme-2").chat.completions.create(model=MODEL, messages=CHAT)  # type: ignore[arg-type]


def test_a_tenant_over_a_count_free_limit_is_refused_before_its_request_is_read(
        setup: tuple[RouterServer, Stub, Path, Path]) -> None:
    """requests_per_second spent: the next request is answered 429 without being read (a body
    that is not even JSON gets the 429, not a 400), in each API's shape, counted and audited."""
    rs, stub, _, audit = setup
    oai(rs, "sk-globex").chat.completions.create(model=MODEL, messages=CHAT)  # type: ignore[arg-type]
    posts = stub.posts
    for path, key_header in (("/v1/chat/completions", "authorization"), ("/v1/messages", "x-api-key")):
        value = "Bearer sk-globex" if key_header == "authorization" else "sk-globex"
        r = httpx.post(rs.url + path, content=b"{not json", headers={key_header: value})
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        body = r.json()
        message = body["error"]["message"]
        assert message == "tenant 'globex' is over its requests_per_second (0.01)"
        if path == "/v1/messages":
            assert body["type"] == "error" and body["error"]["type"] == "rate_limit_error"
        else:
            assert body["error"]["code"] == "rate_limit_exceeded"
    assert stub.posts == posts
    assert rs.metric("tripod:router_tenant_rejections_total", limit="requests_per_second", tenant="globex") == 2
    rows = wait_for(lambda: _lines(audit, 3), "3 audit lines")
    assert [(r["tenant"], r["status"]) for r in rows] == [("globex", 200), ("globex", 429), ("globex", 429)]
