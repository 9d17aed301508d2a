"""``tripod serve --tensor-parallel-size 2`` end to end: the official ``openai`` client gets the
single process's tokens, ``/v1/models`` describes the group, and a worker killed with SIGKILL in
the middle of an answer takes the server to unhealthy (503) promptly: no hang, the stream ends with
an error rather than silence, and the server exits for its supervisor to restart it whole."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.support.server_helpers import ServerProcess
from tests.support.tiny_models import build_hf, save
from tripod import Engine, SamplingParams

pytestmark = pytest.mark.slow  # served TP/DP groups: about 20 s (tests/engine/test_parallel.py covers the engine)


def workers_of(pid: int) -> list[int]:
    """The tensor-parallel workers under the engine process ``pid`` (multiprocessing children
    started by spawn; multiprocessing's resource tracker is a child too, and not one)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:  # gone meanwhile
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid and b"spawn_main" in cmdline:
                out.append(int(entry))
    return out


def test_served_tp2_equals_one_process_and_a_killed_worker_fails_cleanly(tmp_path: Path, hf_tokenizer: Any) -> None:
    folder = save(build_hf("llama"), tmp_path / "llama", hf_tokenizer)
    prompt = list(range(5, 45))
    single = Engine(model=str(folder), dtype="float32", kernels="eager", kv_cache_tokens=2048)
    want = single.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0].token_ids
    srv = ServerProcess(tmp_path, "--model", str(folder), "--tensor-parallel-size", "2", "--kernels", "eager",
                        "--threads", "1", "--parallel-timeout", "10", "--kv-cache-tokens", "2048")
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        card = client.models.list().data[0].model_extra["compute"]["parallel"]
        assert card["tensor_parallel_size"] == 2 and [r["rank"] for r in card["ranks"]] == [0, 1]
        got = client.completions.create(model="llama", prompt=prompt, max_tokens=12, temperature=0,
                                        extra_body={"ignore_eos": True, "return_token_ids": True})
        assert got.choices[0].model_extra["token_ids"] == want

        engine_pid = httpx.get(srv.url + "/health", timeout=10).json()["engine_pid"]
        workers = workers_of(engine_pid)
        assert len(workers) == 1, f"expected one worker process under the engine, found {workers}"
        events: list[Any] = []
        started = threading.Event()

        def stream() -> None:
            try:
                for chunk in client.completions.create(model="llama", prompt=prompt, max_tokens=400, temperature=0,
                                                       stream=True, extra_body={"ignore_eos": True}):
                    events.append(chunk)
                    started.set()
            except Exception as e:
                events.append(e)
            finally:
                started.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert started.wait(60), "the stream never started"
        os.kill(workers[0], signal.SIGKILL)
        deadline = time.monotonic() + 30  # the collective timeout is 10 s; a closed peer fails at once
        status = None
        while time.monotonic() < deadline:
            try:
                status = httpx.get(srv.url + "/health", timeout=5).status_code
            except httpx.HTTPError:
                status = "gone"  # the server exits after its dead-engine grace: also not serving
            if status != 200:
                break
            time.sleep(0.2)
        assert status != 200, "the server still reports healthy 30 s after a tensor-parallel worker was killed"
        reader.join(60)
        assert not reader.is_alive(), "the stream hung after the worker died"
        finished = [e for e in events if not isinstance(e, Exception) and e.choices and e.choices[0].finish_reason]
        assert not finished or finished[-1].choices[0].finish_reason != "length", \
            "the answer claims to have finished although its worker died"
        assert srv.wait_exit(30) != 0, "the server should exit (non-zero) for its supervisor to restart the group"
    finally:
        srv.stop()


def test_served_dp_attention_answers_concurrent_requests_like_one_process(tmp_path: Path, hf_tokenizer: Any) -> None:
    """``tripod serve --data-parallel-size 2`` (DeepSeek-V3, MLA): two requests at once, each on its
    own rank's latent pool, get the single process's tokens through the official client."""
    folder = save(build_hf("deepseek-v3"), tmp_path / "dsv3", hf_tokenizer)
    prompts = [list(range(5, 40)), list(range(60, 81))]
    single = Engine(model=str(folder), dtype="float32", kernels="eager", kv_cache_tokens=1024)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in single.generate(prompts, params)]
    srv = ServerProcess(tmp_path, "--model", str(folder), "--data-parallel-size", "2", "--kernels", "eager",
                        "--threads", "1", "--kv-cache-tokens", "1024")
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        card = client.models.list().data[0].model_extra["compute"]["parallel"]
        assert card["data_parallel_size"] == 2 and card["kv_capacity_tokens"] == 2 * card["ranks"][0]["kv_slots"]
        got: list[Any] = [None, None]

        def ask(i: int) -> None:
            got[i] = client.completions.create(model="dsv3", prompt=prompts[i], max_tokens=10, temperature=0,
                                               extra_body={"ignore_eos": True, "return_token_ids": True})

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert [g.choices[0].model_extra["token_ids"] for g in got] == want
    finally:
        srv.stop()
