"""Tenants end to end on one real ``tripod serve`` over HTTPS (a certificate made in the test):
each limit at its boundary through the official ``openai`` and ``anthropic`` clients (429 with
``Retry-After`` and the limit named, in each API's shape), a live key rotation (SIGHUP) with the
old key refused at once, per-tenant metrics, the audit log (right tenant and counts, no key, no
prompt text), plain HTTP to the TLS port refused cleanly, and a router in front over HTTPS."""

from __future__ import annotations

import hashlib
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.server_helpers import START_TIMEOUT, ServerProcess
from tests.support.tls import Certs, make_certs
from tripod.fleet.process import free_port

TENANTS = """\
[[tenant]]
name = "acme"
keys = ["sk-acme"]
output_tokens_per_minute = 20

[[tenant]]
name = "globex"
keys = ["sk-globex"]
requests_per_second = 0.01   # one per 100 s

[[tenant]]
name = "hooli"
keys = ["sk-hooli"]
max_context = 120

[[tenant]]
name = "initech"
keys = ["sk-initech"]
models = ["another-model"]
"""
SECRET_WORDS = "zebra quokka " * 4  # in prompts: never in the audit log
CHAT = [{"role": "user", "content": f"Say hello. {SECRET_WORDS}"}]


def _poll(cond: Any, what: str, timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)  # polling a state, with a deadline


class TLSServer(ServerProcess):
    """``tripod serve`` with HTTPS: waited for over HTTPS, trusting the test's CA."""

    certs: Certs

    def _wait_ready(self) -> None:
        self.url = f"https://127.0.0.1:{self.port}"

        def healthy() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tripod serve exited with {self.proc.returncode}:\n{self.log()}")
            try:
                return httpx.get(f"{self.url}/health", verify=self.certs.context(), timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        _poll(healthy, "the server to be healthy", START_TIMEOUT)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("tenants")
    certs = make_certs(tmp)
    tenants = tmp / "tenants.toml"
    tenants.write_text(TENANTS)
    audit = tmp / "audit.jsonl"
    TLSServer.certs = certs
    # (--drain-timeout 2: the clients' idle keep-alive connections would hold the stop for the default 60 s)
    srv = TLSServer(tmp, "--tenants", str(tenants), "--audit-log", str(audit), "--ssl-certfile", str(certs.cert),
                    "--ssl-keyfile", str(certs.key), "--drain-timeout", "2", api_key="sk-admin")
    http = httpx.Client(verify=certs.context(), timeout=120)
    try:
        yield {"srv": srv, "certs": certs, "tenants": tenants, "audit": audit, "tmp": tmp, "http": http}
    finally:
        http.close()
        srv.stop()


def oai(env: dict[str, Any], key: str, url: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=(url or env["srv"].url) + "/v1", api_key=key, max_retries=0,
                         http_client=httpx.Client(verify=env["certs"].context(), timeout=120))


def metric(env: dict[str, Any], name: str, **labels: str) -> float:
    text = env["http"].get(env["srv"].url + "/metrics").text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def audit_lines(env: dict[str, Any], tenant: str, n: int) -> list[dict[str, Any]]:
    def read() -> list[dict[str, Any]] | None:
        lines = [json.loads(x) for x in env["audit"].read_text().splitlines()]
        mine = [x for x in lines if x["tenant"] == tenant]
        return mine if len(mine) >= n else None
    return _poll(read, f"{n} audit lines of {tenant}")  # type: ignore[no-any-return]


@pytest.mark.slow
def test_output_budget_exact_at_its_boundary(env: dict[str, Any]) -> None:
    c = oai(env, "sk-acme")

    def ask(n: int) -> Any:
        return c.chat.completions.create(model="default", messages=CHAT, max_tokens=n,  # type: ignore[arg-type]
                                         temperature=0, extra_body={"ignore_eos": True})

    assert ask(8).usage.completion_tokens == 8
    with pytest.raises(openai.RateLimitError) as e:
        ask(13)  # 8 + 13 > 20
    err = e.value.response.json()["error"]
    assert err["message"] == "tenant 'acme' is over its output_tokens_per_minute (20)"
    assert err["code"] == "rate_limit_exceeded"
    assert 1 <= int(e.value.response.headers["retry-after"]) <= 60
    assert ask(12).usage.completion_tokens == 12  # exactly the budget
    with pytest.raises(openai.RateLimitError):
        ask(1)
    with pytest.raises(openai.BadRequestError, match="alone is more than"):
        ask(21)  # never fits: a 400 that says to ask for less
    # Per-tenant series.
    assert metric(env, "tripod:tenant_output_tokens_total", tenant="acme") == 20
    assert metric(env, "tripod:tenant_requests_total", tenant="acme", status="200") == 2
    assert metric(env, "tripod:tenant_requests_total", tenant="acme", status="429") == 2
    assert metric(env, "tripod:tenant_rejections_total", tenant="acme", limit="output_tokens_per_minute") == 3
    assert metric(env, "tripod:tenant_time_to_first_token_seconds_count", tenant="acme") == 2
    assert metric(env, "tripod:tenant_time_per_output_token_seconds_count", tenant="acme") == 2
    # The audit log: one line per request, the right tenant and counts, never the key or the prompt.
    lines = audit_lines(env, "acme", 5)
    assert [(x["status"], x["output_tokens"]) for x in lines] == [(200, 8), (429, 0), (200, 12), (429, 0), (400, 0)]
    assert lines[0]["key_id"] == hashlib.sha256(b"sk-acme").hexdigest()[:12]
    assert lines[0]["route"] == "/v1/chat/completions" and lines[0]["prompt_tokens"] > 0
    text = env["audit"].read_text()
    assert "sk-acme" not in text and "quokka" not in text


def test_max_context_at_its_boundary(env: dict[str, Any]) -> None:
    msgs = [{"role": "user", "content": f"Count: {'one two three ' * 12}"}]
    n = env["http"].post(env["srv"].url + "/tokenize", json={"messages": msgs},
                         headers={"Authorization": "Bearer sk-hooli"}).json()["count"]
    assert n < 120
    c = oai(env, "sk-hooli")
    with pytest.raises(openai.BadRequestError, match=r"max_context \(120\)"):
        c.chat.completions.create(model="default", messages=msgs, max_tokens=121 - n)  # type: ignore[arg-type]
    r = c.chat.completions.create(model="default", messages=msgs, max_tokens=120 - n)  # type: ignore[arg-type]
    assert r.usage is not None and r.usage.prompt_tokens == n


def test_requests_per_second_through_anthropic(env: dict[str, Any]) -> None:
    a = anthropic.Anthropic(base_url=env["srv"].url, api_key="sk-globex", max_retries=0,
                            http_client=anthropic.DefaultHttpxClient(verify=env["certs"].context(), timeout=120))
    msgs: Any = [{"role": "user", "content": "Hi"}]
    assert a.messages.create(model="default", max_tokens=2, messages=msgs).usage.output_tokens >= 1
    with pytest.raises(anthropic.RateLimitError) as e:
        a.messages.create(model="default", max_tokens=2, messages=msgs)
    body: Any = e.value.body
    assert body == {"type": "error", "error": {"type": "rate_limit_error",
                                               "message": "tenant 'globex' is over its requests_per_second (0.01)"}}
    assert 90 <= int(e.value.response.headers["retry-after"]) <= 100


def test_models_and_unknown_keys(env: dict[str, Any]) -> None:
    with pytest.raises(openai.NotFoundError, match="may not use the model"):
        oai(env, "sk-initech").chat.completions.create(model="default", messages=CHAT, max_tokens=1)  # type: ignore[arg-type]
    with pytest.raises(openai.AuthenticationError):
        oai(env, "sk-nobody").chat.completions.create(model="default", messages=CHAT, max_tokens=1)  # type: ignore[arg-type]
    # The plain --api-key is the default tenant's, with no limits.
    oai(env, "sk-admin").chat.completions.create(model="default", messages=CHAT, max_tokens=1)  # type: ignore[arg-type]


def test_stored_responses_are_their_tenants_own(env: dict[str, Any]) -> None:
    """A stored response is found by its own tenant only: another tenant's GET and DELETE are 404s."""
    mine = oai(env, "sk-admin")
    r = mine.responses.create(model="default", input="Say hi.", max_output_tokens=2)
    theirs = oai(env, "sk-hooli")
    with pytest.raises(openai.NotFoundError):
        theirs.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        theirs.responses.delete(r.id)
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        theirs.responses.create(model="default", input="And?", previous_response_id=r.id, max_output_tokens=2)
    assert mine.responses.retrieve(r.id).id == r.id


def test_key_rotation_on_sighup(env: dict[str, Any]) -> None:
    before = metric(env, "tripod:tenant_file_reloads_total", result="ok")
    env["tenants"].write_text(TENANTS.replace('"sk-hooli"', '"sk-hooli-2"'))
    env["srv"].signal(signal.SIGHUP)
    _poll(lambda: metric(env, "tripod:tenant_file_reloads_total", result="ok") > before, "the reload")
    with pytest.raises(openai.AuthenticationError):  # revoked: refused at once
        oai(env, "sk-hooli").chat.completions.create(model="default", messages=CHAT, max_tokens=1)  # type: ignore[arg-type]
    oai(env, "sk-hooli-2").chat.completions.create(model="default", messages=CHAT, max_tokens=1)  # type: ignore[arg-type]
    # An invalid file is refused with its line; the last good one keeps serving.
    env["tenants"].write_text(TENANTS + "\n[[tenant]]\nname = \"x\"\nkeys = [\"y\"]\nweight = -1\n")
    env["srv"].signal(signal.SIGHUP)
    _poll(lambda: metric(env, "tripod:tenant_file_reloads_total", result="kept") >= 1, "the refusal")
    assert "weight must be > 0" in env["srv"].log()
    oai(env, "sk-hooli-2").chat.completions.create(model="default", messages=CHAT, max_tokens=1)  # type: ignore[arg-type]


def test_plain_http_to_the_tls_port_fails_cleanly(env: dict[str, Any]) -> None:
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{env['srv'].port}/health", timeout=10)
    with pytest.raises(httpx.ConnectError):  # nor does a client that does not trust the certificate connect
        httpx.get(f"{env['srv'].url}/health", timeout=10)
    assert env["http"].get(env["srv"].url + "/health").status_code == 200


def test_a_router_over_https_in_front(env: dict[str, Any]) -> None:
    """``tripod route`` serving HTTPS, verifying its replica's certificate with --ssl-ca."""
    certs: Certs = env["certs"]
    bad = env["tmp"] / "bad.toml"
    bad.write_text('[[tenant]]\nname = "a"\nkeys = ["k"]\nmax_concurrent = -2\n')
    refused = subprocess.run([sys.executable, "-m", "tripod.cli", "route", "--replica", env["srv"].url,
                              "--tenants", str(bad), "--port", str(free_port())], capture_output=True, text=True,
                             timeout=60)
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines()[-1] == (f"tripod: error: {bad}:4: max_concurrent must be >= 1 (got -2); "
                                                        "leave it out for no limit")
    good = env["tmp"] / "router-tenants.toml"
    good.write_text(TENANTS)
    port = free_port()
    log = open(env["tmp"] / "route.log", "w")
    cmd = [sys.executable, "-m", "tripod.cli", "route", "--replica", env["srv"].url, "--port", str(port),
           "--ssl-ca", str(certs.ca), "--ssl-certfile", str(certs.cert), "--ssl-keyfile", str(certs.key),
           "--tenants", str(good), "--api-key", "sk-admin", "--health-interval", "0.2", "--drain-timeout", "5"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"https://127.0.0.1:{port}"
    try:
        def routable() -> bool:
            assert proc.poll() is None, (env["tmp"] / "route.log").read_text()
            try:
                return httpx.get(url + "/health", verify=certs.context(), timeout=5).status_code == 200
            except httpx.HTTPError:
                return False
        _poll(routable, "the router to reach its replica over HTTPS")
        with oai(env, "sk-admin", url) as c:
            r = c.chat.completions.create(model="default", messages=CHAT, max_tokens=2)  # type: ignore[arg-type]
        assert r.usage is not None and r.usage.completion_tokens >= 1
        with oai(env, "sk-nobody", url) as c, pytest.raises(openai.AuthenticationError):
            c.chat.completions.create(model="default", messages=CHAT, max_tokens=1)  # type: ignore[arg-type]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)  # (it drains open connections first)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log.close()


@pytest.mark.slow
def test_an_invalid_file_is_refused_at_start_up(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[[tenant]]\nname = "a"\nkeys = ["k"]\n\n[[tenant]]\nname = "a"\nkeys = ["j"]\n')
    r = subprocess.run([sys.executable, "-m", "tripod.cli", "serve", "--tenants", str(bad), "--port", str(free_port())],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == f"tripod: error: {bad}:6: tenant 'a' is defined twice"
