"""``tripod serve`` as a user starts it (the embedded Q4_1 GGUF under ``--weights auto``: executed as
stored with bf16 activations, on the best ISA level the CPU supports), and with ``--weights stored
--dtype float32`` named, through the official ``openai`` client.

On the kernels a request's output does not depend on its batch, so eight greedy chats sent at
once must each equal the same chat sent alone, token for token — through the real server's
continuous batching.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from openai import OpenAI

from tests.support.server_helpers import ServerProcess
from tripod import kernels

pytestmark = pytest.mark.skipif(
    kernels.unavailable_reason() is not None, reason=f"tripod's CPU kernels unavailable: {kernels.unavailable_reason()}"
)


@pytest.fixture(scope="module")
def default_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = ServerProcess(tmp_path_factory.mktemp("default"), "--dtype", "auto", "--kv-cache-tokens", "8192")
    try:
        yield srv
    finally:
        srv.stop()


def _client(srv: ServerProcess) -> OpenAI:
    return OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)


def _chat(client: OpenAI, text: str, max_tokens: int = 40, **kw: Any) -> Any:
    return client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": text}], max_tokens=max_tokens, temperature=0, **kw
    )


def _best_level_from_cpuinfo() -> str:
    """The best kernel level this CPU supports, read from /proc/cpuinfo here (not tripod's code)."""
    flags = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    avx512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags
    if avx512 and {"avx512_bf16", "amx_tile", "amx_bf16"} <= flags:
        # AMX runs by default only where Linux grants the tiles and the level is built and checked
        # (neither is in /proc/cpuinfo).
        from tripod.kernels.build import KernelBuild, level_reason

        if level_reason("amx_bf16") is None and KernelBuild("amx_bf16").is_built():
            return "amx_bf16"
    if avx512 and "avx512_bf16" in flags:
        return "avx512_bf16"
    return "avx512" if avx512 else "avx2"


def test_default_server_runs_the_kernels_and_says_so(default_server: ServerProcess) -> None:
    card = httpx.get(f"{default_server.url}/v1/models", timeout=30).json()["data"][0]
    # --weights auto: a quantized GGUF runs as stored wherever the kernels run, with bf16 activations
    # (--dtype auto: bfloat16 wherever tripod's kernels run, every level computing the same bits).
    assert card["weights"] == "stored" and card["dtype"] == "bfloat16" and card["quantization"] == "Q4_1"
    # The best level this CPU supports, reported where a user looks (make install built it).
    assert card["compute"] == {"backend": "cpu", "isa": _best_level_from_cpuinfo()}, card["compute"]
    stats = default_server.engine_stats()
    assert "tripod CPU kernels, GGUF weights executed as stored" in stats["compute"], stats["compute"]
    assert stats["compute_card"] == card["compute"]


def test_concurrent_chats_equal_each_chat_alone(default_server: ServerProcess) -> None:
    client = _client(default_server)
    questions = [
        "Name three rivers in Europe.", "What is 12 times 12?", "Write a haiku about snow.",
        "Describe a cat in one sentence.", "What is the capital of Japan?", "List two prime numbers.",
        "Say hello in French.", "Why is the sky blue?",
    ]
    alone = [_chat(client, q).choices[0].message.content for q in questions]
    with ThreadPoolExecutor(len(questions)) as pool:
        together = list(pool.map(lambda q: _chat(client, q).choices[0].message.content, questions))
    assert together == alone
    # Streamed: the same text again, in pieces.
    pieces = [c.choices[0].delta.content or "" for c in _chat(client, questions[0], stream=True) if c.choices]
    assert "".join(pieces) == alone[0]
    stats = default_server.wait_idle()
    assert stats["consistent"] is True


def test_structured_output_on_the_default_path(default_server: ServerProcess) -> None:
    schema = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "bright": {"type": "boolean"},
              "shade": {"enum": ["light", "dark"]}}, "required": ["color", "bright", "shade"], "additionalProperties": False}
    r = _chat(_client(default_server), "Pick a colour.", max_tokens=60, response_format={
        "type": "json_schema", "json_schema": {"name": "colour", "schema": schema, "strict": True}})
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)


@pytest.mark.slow
def test_stored_weights_server(tmp_path: Path) -> None:
    srv = ServerProcess(tmp_path, "--dtype", "float32", "--weights", "stored", "--kv-cache-tokens", "4096")
    try:
        card = httpx.get(f"{srv.url}/v1/models", timeout=30).json()["data"][0]
        assert card["weights"] == "stored" and card["dtype"] == "float32" and card["quantization"] == "Q4_1"
        assert "executed as stored" in srv.engine_stats()["compute"]
        assert card["compute"] == {"backend": "cpu", "isa": _best_level_from_cpuinfo()}
        r = _client(srv).completions.create(model="default", prompt="The capital of France is", max_tokens=8, temperature=0)
        assert "Paris" in r.choices[0].text
    finally:
        srv.stop()
