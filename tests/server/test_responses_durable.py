"""The sqlite store behind a real ``tripod serve``: a stored response, and a follow-up on it,
survive SIGTERM and SIGKILL of the server; a foreign store file is refused at start-up (exit 2)."""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from tests.support.server_helpers import ServerProcess


def test_a_foreign_store_file_is_refused_at_start_up(tmp_path: Path) -> None:
    path = tmp_path / "app.db"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE orders (id INTEGER)")
    db.commit()
    db.close()
    p = subprocess.run([sys.executable, "-m", "tripod.cli", "serve", "--port", "0", "--responses-store",
                        f"sqlite:{path}"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "another program's database" in p.stderr, p.stderr


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_stored_responses_survive_the_server(tmp_path: Path, sig: signal.Signals) -> None:
    store = f"sqlite:{tmp_path / 'responses.db'}"
    srv = ServerProcess(tmp_path, "--responses-store", store)
    try:
        c = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120)
        first = c.responses.create(model="default", input="My name is Ada.", max_output_tokens=8, temperature=0)
    finally:
        srv.signal(sig)
        srv.wait_exit(60)
        srv.stop()
    again = ServerProcess(tmp_path, "--responses-store", store)
    try:
        c = openai.OpenAI(base_url=f"{again.url}/v1", api_key="unused", max_retries=0, timeout=120)
        assert c.responses.retrieve(first.id).output_text == first.output_text
        follow = c.responses.create(model="default", input="What is my name?", previous_response_id=first.id,
                                    max_output_tokens=8, temperature=0)
        whole = c.responses.create(model="default", max_output_tokens=8, temperature=0, store=False, input=[
            {"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "What is my name?"}])
        assert follow.output_text == whole.output_text
    finally:
        again.stop()


@pytest.mark.slow
def test_a_dead_servers_background_runs_fail_rather_than_stay_in_progress(tmp_path: Path) -> None:
    """Two replicas on one sqlite file: the second's start-up leaves the first's running background
    responses alone; once the first is SIGKILLed, the one read through the second is failed
    (``server restarted``), and a restart of the first marks the other failed at start-up."""
    store = f"sqlite:{tmp_path / 'responses.db'}"

    def client(s: ServerProcess) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=120)

    a = ServerProcess(tmp_path, "--responses-store", store)
    b: ServerProcess | None = None
    try:
        # (4000 tokens never to end: about a minute and a half here, far past this test's kill)
        runs = [client(a).responses.create(model="default", input=f"Count to a thousand, {i}.", background=True,
                                           max_output_tokens=4000, extra_body={"ignore_eos": True})
                for i in range(2)]
        assert all(r.status in ("queued", "in_progress") for r in runs)
        b = ServerProcess(tmp_path, "--responses-store", store)
        assert client(b).responses.retrieve(runs[0].id).status == "in_progress"  # A is alive: not B's to fail
        a.signal(signal.SIGKILL)
        a.wait_exit(60)
        got = client(b).responses.retrieve(runs[0].id)
        assert got.status == "failed" and got.error is not None and "restarted" in got.error.message
    finally:
        a.stop()
        if b is not None:
            b.stop()
    again = ServerProcess(tmp_path, "--responses-store", store)
    try:
        assert f"marked failed: {runs[1].id}" in again.log()  # by the start-up sweep
        got = client(again).responses.retrieve(runs[1].id)
        assert got.status == "failed" and got.error is not None and "restarted" in got.error.message
    finally:
        again.stop()
