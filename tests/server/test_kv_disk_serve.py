"""A warm restart through real ``tripod serve`` processes with ``--kv-disk``: the second server on the
directory answers the first one's prompt from disk (``usage.prompt_tokens_details.cached_tokens``
through the official ``openai`` client), with the same answer, and says so in ``/debug/engine`` and
``/metrics``."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from tests.support.server_helpers import ServerProcess

SYSTEM = (
    "You are the harbour master's assistant at Port Ellery. Ships must request a berth at least six hours "
    "before arrival, giving their length, draught and cargo. Berths one to four take vessels up to 120 metres; "
    "berth five, the deep-water quay, takes anything up to 240 metres and a draught of 11 metres. Pilotage is "
    "compulsory for vessels over 60 metres and is booked through the same office. Dangerous goods need a "
    "declaration filed a day ahead and are berthed at the eastern quay only. The harbour office is open from "
    "six in the morning to ten at night, and the duty officer can be reached on channel 14 at any hour. Answer "
    "questions from captains and agents briefly and precisely, quoting the rule that applies."
)


def _ask(srv: ServerProcess) -> tuple[str, int, int]:
    client = OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
    r = client.chat.completions.create(
        model="default", max_tokens=8, temperature=0,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Which berth for 200 m?"}],
    )
    assert r.usage is not None and r.usage.prompt_tokens_details is not None
    return r.choices[0].message.content or "", r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens or 0


@pytest.mark.slow
def test_a_restarted_server_serves_the_old_prefix_from_disk(tmp_path: Path) -> None:
    disk = tmp_path / "kv"
    args = ("--kv-disk", str(disk), "--kv-disk-size", "1", "--kv-cache-tokens", "4096")
    first = ServerProcess(tmp_path, *args)
    try:
        answer, prompt_tokens, cached = _ask(first)
        assert prompt_tokens > 150 and cached == 0
        stats = first.wait_idle()
        assert stats["kv_disk"]["hit_tokens"] == 0
    finally:
        first.stop()  # SIGTERM: the engine saves its prefix cache to the tier on the way out
    assert list(disk.glob("*/??/*.kv")), "the first server left its prefixes on disk"

    second = ServerProcess(tmp_path, *args)
    try:
        again, prompt_tokens2, cached2 = _ask(second)
        assert again == answer and prompt_tokens2 == prompt_tokens
        assert cached2 >= prompt_tokens - 16 - 1, "every whole block of the prompt came from disk"
        stats = second.wait_idle()
        assert stats["kv_disk"]["hit_tokens"] == cached2 and stats["kv_disk"]["corrupt_files"] == 0
        assert stats["consistent"] is True
        metrics = httpx.get(f"{second.url}/metrics", timeout=10).text
        hits = re.search(r'tripod:prefix_cache_tier_hits_total\{model_name="[^"]*",tier="disk"\} (\S+)', metrics)
        assert hits is not None and float(hits.group(1)) == cached2
    finally:
        second.stop()
