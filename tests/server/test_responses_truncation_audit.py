"""``truncation`` and the tenant's audit line on ``/v1/responses``, against a real ``tripod serve``
with a short context (``--max-model-len 256``), tenants and an audit log: a follow-up too long for
the context is a 400 naming ``input`` by default, and with ``truncation: "auto"`` drops the oldest
turn, answering exactly as the last turn alone does (greedy); each request's audit line names its
tenant, route, status and token counts (the usage the client got), never the key."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.support.server_helpers import ServerProcess

pytestmark = pytest.mark.slow  # its own server: about 25 s

KEY = "sk-truncation-test"
TENANTS = f'[[tenant]]\nname = "acme"\nkeys = ["{KEY}"]\n'
FIRST = "Remember these words: " + " ".join(["apple", "river", "stone", "cloud"] * 28)
SECOND = "And these: " + " ".join(["green", "table", "music", "light"] * 26) + ". Which word came first?"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Any:
    tmp = tmp_path_factory.mktemp("truncation")
    (tmp / "tenants.toml").write_text(TENANTS)
    srv = ServerProcess(tmp, "--max-model-len", "256", "--tenants", str(tmp / "tenants.toml"),
                        "--audit-log", str(tmp / "audit.jsonl"))
    try:
        yield srv, tmp / "audit.jsonl"
    finally:
        srv.stop()


def audit_lines(path: Path, n: int, timeout: float = 30.0) -> list[dict[str, Any]]:
    """The log's lines for /v1/responses, once there are ``n`` (written as each answer ends)."""
    deadline = time.monotonic() + timeout
    while True:
        lines = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
        mine = [x for x in lines if x["route"] == "/v1/responses"]
        if len(mine) >= n:
            return mine
        if time.monotonic() > deadline:
            raise AssertionError(f"{len(mine)} audit lines for /v1/responses, not {n}: {lines}")
        time.sleep(0.1)  # polling a file, with a deadline


def test_truncation_auto_drops_the_oldest_turn_and_the_audit_line_counts(served: Any) -> None:
    srv, audit = served
    c = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=KEY, max_retries=0, timeout=120)
    kw: dict[str, Any] = dict(model="default", max_output_tokens=16, temperature=0)
    first = c.responses.create(input=FIRST, **kw)
    assert first.usage is not None and first.usage.input_tokens > 110
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(input=SECOND, previous_response_id=first.id, **kw)
    assert e.value.body["param"] == "input" and e.value.body["code"] == "context_length_exceeded"
    cut = c.responses.create(input=SECOND, previous_response_id=first.id, truncation="auto", **kw)
    alone = c.responses.create(input=SECOND, store=False, **kw)
    assert cut.truncation == "auto" and cut.status in ("completed", "incomplete")
    assert cut.usage is not None and alone.usage is not None
    assert cut.usage.input_tokens == alone.usage.input_tokens and cut.usage.input_tokens + 16 <= 256
    assert cut.output_text == alone.output_text  # the first turn dropped, token for token

    lines = audit_lines(audit, 4)
    assert [x["status"] for x in lines] == [200, 400, 200, 200]
    for line, r in ((lines[0], first), (lines[2], cut), (lines[3], alone)):
        assert line["tenant"] == "acme" and line["model"]
        assert line["prompt_tokens"] == r.usage.input_tokens and line["output_tokens"] == r.usage.output_tokens
    assert KEY not in audit.read_text()
