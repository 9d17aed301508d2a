"""The audit log's writer: lines in order off the caller's thread, the prompt only when asked for,
rotation by size; and the gate's accounting of one request (lease released, counts, audit line)."""

from __future__ import annotations

import json
from pathlib import Path

from prometheus_client import CollectorRegistry

from tripod.tenants import AuditLine, AuditLog, TenantGate, TenantMetrics, TenantRegistry


def line(i: int, prompt: str | None = None) -> AuditLine:
    return AuditLine(time="t", tenant="acme", key_id="abc", route="/v1/completions", model="m", status=200,
                     prompt_tokens=i, output_tokens=2 * i, latency_s=0.5, prompt=prompt)


def test_lines_in_order_without_the_prompt_unless_asked(tmp_path: Path) -> None:
    log = AuditLog(str(tmp_path / "a.jsonl"))
    for i in range(50):
        log.write(line(i, prompt="secret words"))
    assert log.flush()
    rows = [json.loads(x) for x in (tmp_path / "a.jsonl").read_text().splitlines()]
    assert [r["prompt_tokens"] for r in rows] == list(range(50)) and all("prompt" not in r for r in rows)
    log.close()
    with_content = AuditLog(str(tmp_path / "b.jsonl"), content=True)
    with_content.write(line(1, prompt="secret words"))
    with_content.close()
    assert json.loads((tmp_path / "b.jsonl").read_text())["prompt"] == "secret words"


def test_rotated_by_size(tmp_path: Path) -> None:
    log = AuditLog(str(tmp_path / "a.jsonl"), max_bytes=1000, backups=2)
    for i in range(100):
        log.write(line(i))
    log.close()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["a.jsonl", "a.jsonl.1", "a.jsonl.2"]
    assert all(p.stat().st_size <= 1000 for p in tmp_path.iterdir())
    last = [json.loads(x) for x in (tmp_path / "a.jsonl").read_text().splitlines()]
    assert last[-1]["prompt_tokens"] == 99  # the newest lines are in the live file


def test_the_gate_finishes_a_request(tmp_path: Path) -> None:
    p = tmp_path / "t.toml"
    p.write_text('[[tenant]]\nname = "acme"\nkeys = ["sk-a"]\nmax_concurrent = 1\noutput_tokens_per_minute = 10\n')
    registry = CollectorRegistry()
    gate = TenantGate(TenantRegistry(str(p), None), TenantMetrics(registry, "t_"), AuditLog(str(tmp_path / "a")))
    rec = gate.identify({b"x-api-key": b"sk-a"}, "/v1/messages")
    assert rec is not None and rec.tenant == "acme"
    assert gate.identify({b"authorization": b"Bearer sk-b"}, "/v1/messages") is None
    gate.admit(rec, input_tokens=5, output_tokens=10)
    rec.status, rec.prompt_tokens, rec.output_tokens = 200, 5, 4
    gate.finish(rec)
    again = gate.identify({b"authorization": b"Bearer sk-a"}, "/v1/messages")
    assert again is not None
    gate.admit(again, input_tokens=5, output_tokens=6)  # the slot and the 6 unused tokens came back
    assert registry.get_sample_value("t_output_tokens_total", {"tenant": "acme"}) == 4
    assert registry.get_sample_value("t_requests_total", {"tenant": "acme", "status": "200"}) == 1
    gate.close()
    row = json.loads((tmp_path / "a").read_text())
    assert (row["tenant"], row["route"], row["output_tokens"], row["key_id"]) == ("acme", "/v1/messages", 4,
                                                                                 rec.identity.key_id)
