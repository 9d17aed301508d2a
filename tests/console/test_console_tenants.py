"""The console's per-tenant view (``GET /ui/api/tenants``): a router with tenants over a stub replica
(real HTTP, no model) answers each tenant's requests by status, tokens, rejections by limit and
TTFT/TPOT percentiles, behind the console's key; the same view from a server's own series; the page
has the table that shows it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.router.stubs import CHAT, MODEL, RouterServer, Stub, wait_for
from tripod.config import RouterConfig
from tripod.console.tenants import tenant_views
from tripod.server.metrics import ServerMetrics

TENANTS = """\
[[tenant]]
name = "acme"
keys = ["sk-acme"]

[[tenant]]
name = "globex"
keys = ["sk-globex"]
requests_per_second = 0.01   # one per 100 s: the second is refused however slow the test runs
"""


@pytest.fixture
def router(tmp_path: Path) -> Iterator[RouterServer]:
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(TENANTS)
    stub = Stub("a")
    rs = RouterServer([("a", stub.url)], RouterConfig(
        policy="round_robin", health_interval=0.1, health_timeout=1.0, metrics_interval=0.1, open_cooldown=0.2,
        queue_timeout=2.0, connect_timeout=2.0, request_timeout=10.0, retry_after=1, tenants=str(tenants),
        api_key="sk-admin"))
    try:
        wait_for(lambda: rs.states().get("a") == "healthy", "the stub routable")
        yield rs
    finally:
        rs.stop()
        stub.stop()


def oai(rs: RouterServer, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=rs.url + "/v1", api_key=key, max_retries=0, timeout=10)


def test_the_router_console_shows_each_tenant(router: RouterServer) -> None:
    for _ in range(3):
        oai(router, "sk-acme").chat.completions.create(model=MODEL, messages=CHAT)  # type: ignore[arg-type]
    oai(router, "sk-globex").chat.completions.create(model=MODEL, messages=CHAT)  # type: ignore[arg-type]
    with pytest.raises(openai.RateLimitError):
        oai(router, "sk-globex").chat.completions.create(model=MODEL, messages=CHAT)  # type: ignore[arg-type]
    assert router.http.get("/ui/api/tenants").status_code == 401  # the console's key, as its other routes
    r = router.http.get("/ui/api/tenants", headers={"Authorization": "Bearer sk-admin"})
    assert r.status_code == 200
    view = r.json()
    assert view["source"] == "router"
    by = {t["name"]: t for t in view["tenants"]}
    assert set(by) == {"acme", "globex"}
    acme, globex = by["acme"], by["globex"]
    assert (acme["requests"], acme["by_status"], acme["errors"]) == (3, {"200": 3}, 0)
    assert (acme["prompt_tokens"], acme["output_tokens"]) == (3, 9)  # the stub's usage: 1 + 3 tokens each
    assert acme["rejections"] == {}
    assert acme["ttft_p50_ms"] is not None and 0 < acme["ttft_p50_ms"] <= acme["ttft_p99_ms"]
    assert (globex["requests"], globex["by_status"], globex["errors"]) == (2, {"200": 1, "429": 1}, 1)
    assert globex["rejections"] == {"requests_per_second": 1}
    page = router.http.get("/ui").text
    assert 'id="tenants-table"' in page


def test_a_servers_series_make_the_same_view() -> None:
    m = ServerMetrics("m")
    t = m.tenants
    t.requests.labels("acme", "200").inc(4)
    t.requests.labels("acme", "429").inc(1)
    t.rejections.labels("acme", "output_tokens_per_minute").inc(1)
    t.output_tokens.labels("acme").inc(40)
    t.prompt_tokens.labels("acme").inc(12)
    for v in (0.04, 0.04, 0.04, 0.4):  # TTFT: 3 in (0.025, 0.05], 1 in (0.3, 0.5]
        t.ttft.labels("acme").observe(v)
    t.tpot.labels("acme").observe(0.012)
    view = tenant_views(m.registry.collect(), "server")
    assert view.source == "server" and [x.name for x in view.tenants] == ["acme"]
    a = view.tenants[0]
    assert (a.requests, a.errors, a.output_tokens, a.prompt_tokens) == (5, 1, 40, 12)
    assert a.rejections == {"output_tokens_per_minute": 1}
    assert a.ttft_p50_ms is not None and 25 < a.ttft_p50_ms <= 50  # rank 2 of 4: in the (25, 50] ms bucket
    assert a.ttft_p99_ms is not None and 300 < a.ttft_p99_ms <= 500
    assert a.tpot_p50_ms is not None and 10 < a.tpot_p50_ms <= 20
    assert tenant_views(ServerMetrics("m").registry.collect(), "server").tenants == []  # none yet


def test_the_page_shows_the_tenants_table(router: RouterServer) -> None:
    """In a real headless browser (Debian's chromium; skipped without it): the Fleet page's
    Tenants table has a row per tenant with its counts."""
    from tests.console.test_console_browser import chromium_or_skip

    chromium = chromium_or_skip()
    from playwright.sync_api import expect, sync_playwright

    for _ in range(2):
        oai(router, "sk-acme").chat.completions.create(model=MODEL, messages=CHAT)  # type: ignore[arg-type]
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, headless=True)
        try:
            tab = browser.new_page()
            errors: list[str] = []
            tab.on("pageerror", lambda e: errors.append(str(e)))
            tab.goto(router.url + "/ui#fleet")
            expect(tab.locator("#login")).to_be_visible(timeout=15_000)
            tab.fill("#login-key", "sk-admin")
            tab.click("#login-submit")
            row = tab.locator('#tenants-table tr[data-tenant="acme"]')
            expect(row).to_have_count(1, timeout=15_000)
            cells = row.locator("td")
            expect(cells.nth(0)).to_have_text("acme")
            expect(cells.nth(1)).to_have_text("2")  # requests
            expect(cells.nth(2)).to_have_text("0")  # errors
            expect(cells.nth(4)).to_have_text("6")  # output tokens (the stub's 3 per answer)
            assert "since the router started" in tab.locator("#tenants-note").inner_text()
            assert not errors, errors
        finally:
            browser.close()
