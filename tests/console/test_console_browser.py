"""The console (``GET /ui``) in a real headless browser, on a real fleet (``tripod serve --replicas 2
--api-key ... --bench-dir ...``) of the embedded model: the key prompt, the playground (a streamed
answer and a schema-valid JSON answer; a conversation over the Responses API), a live chart under load, the benchmark history with a
slower run flagged, and the fleet view showing a replica go down when it is killed.

The browser is Debian's ``chromium`` driven by Playwright for Python (never a downloaded browser
build); ``make test`` installs it when it can (``make browser``). Without it these tests skip and
say why. Each view's screenshot is saved under ``$TRIPOD_ARTIFACTS`` (default ``test-artifacts/``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.bench_fixtures import write_run
from tests.support.server_helpers import TripodProcess

pytestmark = pytest.mark.slow  # a fleet and headless Chromium: about 25 s

KEY = "console-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
REPLICA_ARGS = ("--dtype", "float32", "--kernels", "optimized", "--kv-cache-tokens", "8192", "--threads", "1")
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
ARTIFACTS = Path(os.environ.get("TRIPOD_ARTIFACTS") or Path(__file__).resolve().parents[2] / "test-artifacts")


def chromium_or_skip() -> str:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        pytest.skip("Playwright for Python is not installed (it is in the 'test' extra: pip install -e '.[test]')")
    path = os.environ.get("TRIPOD_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if not path:
        pytest.skip("no chromium on this machine: `make test` installs Debian's with apt-get when it can "
                    "(root + apt-get; `make browser`); or set TRIPOD_CHROMIUM to a Chromium binary")
    return path


@pytest.fixture(scope="module")
def bench_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two runs as tripod bench writes them: a week apart, the second clearly slower."""
    root = tmp_path_factory.mktemp("bench")
    write_run(root / "2026-11-20", "2026-11-20T09:00:00", decode_rate=60.0, levels=[1, 4], cost_per_hour=1.2)
    write_run(root / "2026-11-27", "2026-11-27T09:00:00", decode_rate=38.0, ttft=0.35, levels=[1, 4],
              cost_per_hour=1.2, seed=3)
    return root


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, bench_dir: Path) -> Iterator[TripodProcess]:
    tmp = tmp_path_factory.mktemp("console-fleet")
    proc = TripodProcess(tmp, "serve", "--replicas", "2", "--api-key", KEY, "--bench-dir", str(bench_dir),
                         "--health-interval", "0.5", "--replica-log-dir", str(tmp), *REPLICA_ARGS)
    try:
        proc.wait_for("two healthy replicas", lambda f: sum(r["state"] == "healthy" for r in f["replicas"]) == 2, 120)
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def chromium() -> str:
    return chromium_or_skip()


@pytest.fixture(scope="module")
def page(chromium: str, fleet: TripodProcess) -> Iterator[Any]:
    """One browser tab on the fleet's console, logged in with the API key through the page's prompt.
    (``chromium`` first: without a browser the tests skip before a fleet is started for them.)"""
    from playwright.sync_api import expect, sync_playwright

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, headless=True)
        tab = browser.new_page(viewport={"width": 1400, "height": 900})
        errors: list[str] = []
        tab.on("pageerror", lambda e: errors.append(str(e)))
        tab.goto(fleet.url + "/ui#fleet")
        expect(tab.locator("#login")).to_be_visible(timeout=15_000)  # the API needs the key
        tab.fill("#login-key", KEY)
        tab.click("#login-submit")
        tab.wait_for_selector("body[data-ready='1']", timeout=15_000)
        tab.errors = errors
        yield tab
        browser.close()
    assert not errors, errors


def _shot(page: Any, name: str) -> None:
    page.screenshot(path=str(ARTIFACTS / f"console-{name}.png"), full_page=True)


def test_console_api_needs_the_key_and_serves_the_page_without_it(fleet: TripodProcess) -> None:
    r = httpx.get(fleet.url + "/ui", timeout=10)
    assert r.status_code == 200 and "tripod console" in r.text
    assert httpx.get(fleet.url + "/ui/static/app.js", timeout=10).status_code == 200
    assert httpx.get(fleet.url + "/ui/api/fleet", timeout=10).status_code == 401
    f = httpx.get(fleet.url + "/ui/api/fleet", headers=AUTH, timeout=10).json()
    assert f["kind"] == "fleet" and [n["name"] for n in f["nodes"]] == ["replica-0", "replica-1"]
    assert f["autoscaler"]["min_replicas"] == 2 and f["autoscaler"]["active"] == 2
    info = httpx.get(fleet.url + "/ui/api/info", headers=AUTH, timeout=10).json()
    assert info["auth"] is True and info["model"] == "SmolLM2-135M-Instruct"


def _send(page: Any, text: str) -> Any:
    """Send ``text`` from the playground and wait for the answer; returns its bubble. Counts the
    answer's DOM updates as they happen (a stream shows up as many)."""
    page.evaluate("""() => {
        window.__updates = 0;
        const t = document.getElementById('pg-transcript');
        new MutationObserver((ms) => { for (const m of ms) if (m.target.closest && m.target.closest('.msg.assistant .text')
            || m.target.parentElement?.closest('.msg.assistant .text')) window.__updates++; })
          .observe(t, {subtree: true, childList: true, characterData: true});
    }""")
    page.fill("#pg-input", text)
    page.click("#pg-send")
    bubble = page.locator(".msg.assistant").last
    from playwright.sync_api import expect

    expect(bubble).to_have_attribute("data-done", "1", timeout=90_000)
    assert page.inner_text("#pg-error") == ""
    return bubble


def test_playground_streams_an_answer_and_a_schema_valid_json_answer(page: Any) -> None:
    import jsonschema

    page.goto(page.url.split("#")[0] + "#playground")
    page.wait_for_function("document.querySelectorAll('#pg-model option').length > 0", timeout=15_000)
    page.fill("#pg-temperature", "0")
    page.fill("#pg-max_tokens", "24")
    bubble = _send(page, "Name three colors.")
    text = bubble.locator(".text").inner_text()
    assert text.strip(), "empty answer"
    assert int(bubble.get_attribute("data-chunks")) > 3  # one SSE delta per token, shown as it came
    assert page.evaluate("window.__updates") > 3
    assert "TTFT" in page.inner_text("#pg-stats")
    curl, python = page.inner_text("#pg-curl"), page.inner_text("#pg-python")
    assert "/v1/chat/completions" in curl and '"stream": true' in curl and "Authorization: Bearer" in curl
    assert "from openai import OpenAI" in python and "max_tokens=24" in python and "temperature=0" in python

    page.click("#pg-clear")
    page.fill("#pg-max_tokens", "64")
    page.fill("#pg-schema", json.dumps(PERSON, indent=2))
    bubble = _send(page, "Invent a person.")
    answer = json.loads(bubble.locator(".text").inner_text())
    jsonschema.validate(answer, PERSON)
    assert "valid JSON" in bubble.locator(".check").inner_text()
    assert "response_format" in page.inner_text("#pg-python") and '"json_schema"' in page.inner_text("#pg-curl")
    _shot(page, "playground")


def test_playground_over_the_responses_api_keeps_the_conversation(page: Any) -> None:
    """With the Responses API chosen, a second turn sends only its input and the first answer's id
    (``previous_response_id``); the fleet's router sends it back to the replica that answered (its
    store has the first turn, the other replica's does not; its prefix cache holds the prompt)."""
    page.goto(page.url.split("#")[0] + "#playground")
    page.wait_for_function("document.querySelectorAll('#pg-model option').length > 0", timeout=15_000)
    page.select_option("#pg-api", "responses")
    assert page.locator(".msg").count() == 0  # a new API, a new conversation
    page.fill("#pg-schema", "")
    page.fill("#pg-temperature", "0")
    page.fill("#pg-max_tokens", "24")
    first = _send(page, "My name is Ada. Say hello to me.")
    assert first.locator(".text").inner_text().strip() and int(first.get_attribute("data-chunks")) > 3
    assert "/v1/responses" in page.inner_text("#pg-curl") and "previous_response_id" not in page.inner_text("#pg-curl")
    second = _send(page, "What is my name?")
    assert second.locator(".text").inner_text().strip()
    curl, python = page.inner_text("#pg-curl"), page.inner_text("#pg-python")
    assert '"previous_response_id": "resp_' in curl and '"input": "What is my name?"' in curl
    assert "client.responses.create(" in python and "max_output_tokens=24" in python
    assert "prompt tokens cached" in page.inner_text("#pg-stats")
    _shot(page, "playground-responses")


def _load(url: str, n: int = 6, tokens: int = 64) -> None:
    def one(i: int) -> None:
        r = httpx.post(url + "/v1/completions", headers=AUTH, timeout=120, json={
            "prompt": f"Request {i}: tell me about rivers", "max_tokens": tokens, "ignore_eos": True})
        r.raise_for_status()

    with ThreadPoolExecutor(n) as pool:
        list(pool.map(one, range(n)))


def test_a_live_chart_updates_under_load(page: Any, fleet: TripodProcess) -> None:
    page.goto(page.url.split("#")[0] + "#live")
    page.select_option("#live-span", "60")
    tok = "document.getElementById('chart-tok_s').dataset"
    # Idle first (the playground's tokens have left the 5 s window): the latest rate drawn is 0.
    page.wait_for_function(f"{tok}.last === '0'", timeout=30_000)
    with ThreadPoolExecutor(1) as pool:
        load = pool.submit(_load, fleet.url)
        # While the load runs, the output tok/s chart's newest point rises above zero.
        page.wait_for_function(f"Number({tok}.last) > 0", timeout=30_000)
        load.result(timeout=120)
    page.wait_for_function("Number(document.getElementById('chart-ttft').dataset.points) > 0", timeout=15_000)
    peak = float(page.evaluate(f"{tok}.max"))
    series = httpx.get(fleet.url + "/ui/api/series", headers=AUTH, timeout=10).json()["points"]
    assert peak > 0 and any(p["output_tok_s"] == pytest.approx(peak, rel=1e-9) for p in series)  # the server's sample
    assert any(p["running"] > 0 for p in series) and any((p["kv_usage_max"] or 0) > 0 for p in series)
    _shot(page, "live")


def test_bench_history_renders_two_runs_and_flags_the_slower_one(page: Any) -> None:
    from playwright.sync_api import expect

    page.goto(page.url.split("#")[0] + "#bench")
    rows = page.locator("#bench-runs tbody tr")
    expect(rows).to_have_count(2, timeout=15_000)
    assert [rows.nth(i).get_attribute("data-run") for i in range(2)] == ["2026-11-27", "2026-11-20"]  # newest first
    expect(page.locator('#bench-runs tr[data-run="2026-11-27"]')).to_have_class("flagged")
    assert "flagged" not in (page.locator('#bench-runs tr[data-run="2026-11-20"]').get_attribute("class") or "")
    assert "$" in rows.nth(0).inner_text()  # cost per million output tokens (--cost-per-hour)
    pareto = page.locator("#bench-pareto canvas")
    expect(pareto).to_have_count(2)  # side by side, one per run
    assert [pareto.nth(i).get_attribute("data-points") for i in range(2)] == ["2", "2"]  # C=1 and C=4
    flags = page.locator("#history-flags li.flag:not(.ttft)")
    expect(flags).to_have_count(2)  # both settings (C=1, C=4) got slower
    assert all("2026-11-27" in flags.nth(i).inner_text() and "vs 2026-11-20" in flags.nth(i).inner_text()
               for i in range(2))
    assert page.locator("#chart-history-tput").get_attribute("data-flagged") == "1"
    assert page.locator("#chart-history-tput").get_attribute("data-points") == "2"
    _shot(page, "bench")


def test_fleet_view_lists_two_replicas_and_shows_one_going_down(page: Any, fleet: TripodProcess) -> None:
    from playwright.sync_api import expect

    page.goto(page.url.split("#")[0] + "#fleet")
    rows = page.locator("#fleet-table tbody tr")
    expect(rows).to_have_count(2, timeout=15_000)
    for name in ("replica-0", "replica-1"):
        expect(page.locator(f'tr[data-node="{name}"]')).to_have_attribute("data-state", "healthy", timeout=15_000)
    page.wait_for_function("document.getElementById('chart-nodes').dataset.last === '2'", timeout=15_000)
    _shot(page, "fleet")

    victim = fleet.replica("replica-1")
    assert victim is not None and victim["pid"]
    os.kill(victim["pid"], signal.SIGKILL)
    killed_at = time.monotonic()
    row = page.locator('tr[data-node="replica-1"]')
    # The router's probe opens its circuit (unhealthy), the supervisor sees the exit (down, a restart
    # scheduled) and relaunches it (starting): whichever the page catches, it is not healthy.
    expect(row).not_to_have_attribute("data-state", "healthy", timeout=15_000)
    assert row.get_attribute("data-state") in ("unhealthy", "down", "starting")
    expect(page.locator('tr[data-node="replica-0"]')).to_have_attribute("data-state", "healthy")
    expect(page.locator("#fleet-events li").filter(has_text="replica-1 healthy →")).to_have_count(1, timeout=10_000)
    page.wait_for_function("document.getElementById('chart-nodes').dataset.min === '1'", timeout=15_000)
    _shot(page, "fleet-replica-down")
    assert time.monotonic() - killed_at < 30
