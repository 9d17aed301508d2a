"""Property-based fuzzing of the HTTP API from its OpenAPI document (schemathesis, through pytest),
against a real ``tripod serve``: no answer is a 5xx, every 4xx (and anything else not 200) comes
in the documented error shape of its API (OpenAI's, or Anthropic's on ``/v1/messages``), and the
server is still healthy afterwards, with no request left in its engine and its KV accounted for.

The document is the one the server serves at ``/openapi.json`` (``tripod/server/api/openapi.py``:
request bodies are the routes' own pydantic models). Generation is kept cheap: a valid
``max_tokens`` (``/v1/responses``: ``max_output_tokens``) above 4 (or none) becomes 4 and ``n`` at most 2, so answers take milliseconds;
invalid values are sent as generated. Half the bodies name the served model (``"default"``) so
that cases get past the model check into the deeper validation.

By default a smoke run (3 examples per operation, plus schemathesis' coverage cases: a couple of
thousand requests in seconds); ``-m slow`` the long run (``TRIPOD_FUZZ_REPORT=path`` writes its
figures as markdown: benchmarks/results/api_fuzz.md).
"""

from __future__ import annotations

import collections
import os
import time
import zlib
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
import schemathesis.checks as checks
from hypothesis import HealthCheck, settings

from tests.support.server_helpers import ServerProcess
from tripod.server.api.openapi import api_document

schema = schemathesis.openapi.from_dict(api_document())
SEEN: collections.Counter[tuple[str, str, int]] = collections.Counter()
# per operation, in the slow run (CI: 300; the recorded report, benchmarks/results/api_fuzz.md: 1000)
LONG_EXAMPLES = int(os.environ.get("TRIPOD_FUZZ_EXAMPLES", "300"))
STARTED = time.monotonic()


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    srv = ServerProcess(tmp_path_factory.mktemp("fuzz"), "--threads", "1", "--max-n", "4")
    yield srv
    srv.stop()


def cheap(body: Any) -> None:
    """Bound the work a valid body asks for; leave invalid values as they are."""
    if not isinstance(body, dict):
        return
    for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        v = body.get(key)
        if (v is None and key == ("max_output_tokens" if "input" in body else "max_tokens")) or (type(v) is int and v > 4):
            body[key] = 4
    if type(body.get("n")) is int and body["n"] > 2:
        body["n"] = 2
    if zlib.crc32(repr(sorted(body)).encode()) % 2:
        body["model"] = "default"


def check(case: Any, server: ServerProcess) -> None:
    cheap(case.body)
    resp = case.call(base_url=server.url, timeout=120)
    SEEN[(case.method, case.path, resp.status_code)] += 1
    case.validate_response(resp, checks=[checks.not_a_server_error, checks.response_schema_conformance])


@schema.parametrize()
@settings(max_examples=3, deadline=None, database=None, suppress_health_check=list(HealthCheck))
def test_fuzz_smoke(case: Any, fuzz_server: ServerProcess) -> None:
    check(case, fuzz_server)


@pytest.mark.slow
@schema.parametrize()
@settings(max_examples=LONG_EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
def test_fuzz_long(case: Any, fuzz_server: ServerProcess) -> None:
    check(case, fuzz_server)


def test_server_healthy_after_fuzzing(fuzz_server: ServerProcess) -> None:
    """(Runs after the fuzzing above, in file order.)"""
    assert SEEN, "nothing was fuzzed"
    assert not [k for k in SEEN if k[2] >= 500]
    r = httpx.get(fuzz_server.url + "/health", timeout=10)
    assert r.status_code == 200 and r.json()["status"] == "ok"
    stats = fuzz_server.wait_idle()  # nothing left in the engine, KV accounted for (checked when idle)
    assert stats["running"] == 0 and stats["waiting"] == 0
    ok = httpx.post(fuzz_server.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 3}, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
    out = os.environ.get("TRIPOD_FUZZ_REPORT")
    if out:
        write_report(Path(out))


def write_report(path: Path) -> None:
    by_status = collections.Counter()
    for (_, _, status), n in SEEN.items():
        by_status[status] += n
    ops = sorted({(m, p) for m, p, _ in SEEN})
    lines = [
        "# HTTP API fuzzing (schemathesis, from the OpenAPI document)", "",
        f"- date: {time.strftime('%Y-%m-%dT%H:%M:%S%z')}",
        f"- schemathesis {schemathesis.SCHEMATHESIS_VERSION}; `TRIPOD_FUZZ_REPORT="
        f"{os.path.relpath(path, Path(__file__).resolve().parents[2])} TRIPOD_FUZZ_EXAMPLES={LONG_EXAMPLES} python -m pytest -m "
        f"'slow or not slow' tests/server/test_api_fuzz.py` (smoke + long: {LONG_EXAMPLES} examples per operation, plus "
        "schemathesis' coverage cases)",
        "- server: `tripod serve --dtype float32 --kernels optimized --threads 1 --max-n 4` (embedded SmolLM2-135M)",
        "- checks: no 5xx; every non-200 answer matches the documented error schema of its API; after the run "
        "`/health` is 200, the engine is idle with its KV accounted for, and a completion is served",
        f"- requests: {sum(SEEN.values())} in {time.monotonic() - STARTED:.0f} s; 5xx: "
        f"{sum(n for (_, _, s), n in SEEN.items() if s >= 500)}", "",
        "| status | requests |", "|---|---|",
        *[f"| {s} | {n} |" for s, n in sorted(by_status.items())], "",
        "| operation | requests | statuses |", "|---|---|---|",
    ]
    for m, p in ops:
        st = {s: n for (mm, pp, s), n in SEEN.items() if (mm, pp) == (m, p)}
        lines.append(f"| {m} {p} | {sum(st.values())} | " + ", ".join(f"{s}: {n}" for s, n in sorted(st.items())) + " |")
    path.write_text("\n".join(lines) + "\n")
