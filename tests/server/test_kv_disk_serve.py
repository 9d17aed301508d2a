"""Real ``tripod serve`` processes with ``--kv-disk``. A warm restart: the second server on the
directory answers the first one's prompt from disk (``usage.prompt_tokens_details.cached_tokens``
through the official ``openai`` client), with the same answer, and says so in ``/debug/engine`` and
``/metrics``. Sharing: two servers live on one directory, the second answers from what the first
evicted."""

from __future__ import annotations

import re
import signal
import time
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


def _asked_again(srv: ServerProcess, answer: str, prompt_tokens: int) -> int:
    """The restarted server's answer to the same question: the same, its prompt's whole blocks
    from disk (how many tokens were cached)."""
    again, prompt_tokens2, cached = _ask(srv)
    assert again == answer and prompt_tokens2 == prompt_tokens
    assert cached >= prompt_tokens - 16 - 1, "every whole block of the prompt came from disk"
    return cached


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
        cached2 = _asked_again(second, answer, prompt_tokens)
        stats = second.wait_idle()
        assert stats["kv_disk"]["hit_tokens"] == cached2 and stats["kv_disk"]["corrupt_files"] == 0
        assert stats["consistent"] is True
        metrics = httpx.get(f"{second.url}/metrics", timeout=10).text
        hits = re.search(r'tripod:prefix_cache_tier_hits_total\{model_name="[^"]*",tier="disk"\} (\S+)', metrics)
        assert hits is not None and float(hits.group(1)) == cached2
    finally:
        second.stop()


@pytest.mark.slow  # (moved out of the default run: CI runs it)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT],
                         ids=["SIGTERM", "SIGINT"])
def test_a_signal_to_the_whole_group_drains_and_saves_the_pool(tmp_path: Path, sig: int) -> None:
    """systemd's default stop (SIGTERM to the control group) or Ctrl-C (SIGINT to the terminal's
    foreground group) reach the engine process too: it must leave the stop to its server, which
    drains, has the engine save its prefix cache to the disk tier and exits 0, so the restart on
    the same directory is warm."""
    disk = tmp_path / "kv"
    args = ("--kv-disk", str(disk), "--kv-disk-size", "1", "--kv-cache-tokens", "4096")
    first = ServerProcess(tmp_path, *args, own_group=True)
    try:
        answer, prompt_tokens, cached = _ask(first)
        assert cached == 0
        first.wait_idle()
        assert not list(disk.glob("*/??/*.kv")), "nothing was evicted: the pool alone holds the prompt"
        first.signal_group(sig)
        code = first.wait_exit(60)
        log = first.log()
    finally:
        first.stop()
    assert code == 0, f"the server exited {code} on a group-wide {signal.Signals(sig).name}:\n{log[-3000:]}"
    assert "engine process exited" not in log, log[-3000:]
    assert list(disk.glob("*/??/*.kv")), "the engine saved its prefix cache to the tier on the way out"

    second = ServerProcess(tmp_path, *args)
    try:
        _asked_again(second, answer, prompt_tokens)
    finally:
        second.stop()


def _other_prompt(srv: ServerProcess) -> None:
    client = OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
    filler = " ".join(f"Cargo manifest line {i}: crates of tinned fish, rope and lamp oil." for i in range(25))
    client.chat.completions.create(model="default", max_tokens=4, temperature=0,
                                   messages=[{"role": "user", "content": filler}])


@pytest.mark.slow
def test_two_servers_on_one_directory_share_what_one_evicted(tmp_path: Path) -> None:
    disk = tmp_path / "kv"
    args = ("--kv-disk", str(disk), "--kv-cache-tokens", "640")
    a = ServerProcess(tmp_path, *args)
    b = ServerProcess(tmp_path, *args)  # both live on the directory at once
    try:
        answer, prompt_tokens, cached = _ask(a)
        assert cached == 0
        _other_prompt(a)  # a's pool cannot hold both: the first prompt is evicted, written to disk
        deadline = time.monotonic() + 60
        while True:  # the writer thread publishes in the background: wait for what a queued
            d = a.wait_idle()["kv_disk"]
            if d["saved_tokens"] >= prompt_tokens - 16 and d["written_blocks"] * 16 == d["saved_tokens"]:
                break
            assert time.monotonic() < deadline, f"a did not write its evicted prefix: {d}"
            time.sleep(0.1)
        again, _, cached_b = _ask(b)
        assert again == answer
        assert cached_b >= prompt_tokens - 16 - 1 and b.wait_idle()["kv_disk"]["hit_tokens"] == cached_b
    finally:
        a.stop()
        b.stop()
