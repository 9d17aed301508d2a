"""Quick numbers for issue 36: the memory and sqlite response stores (time per put / get) and
all-MiniLM-L6-v2 embeddings through a real ``tripod serve`` (64 texts in one request vs one text
per request). Run from the repository root: ``PYTHONPATH=. python benchmarks/responses_store_embed_probe.py``.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import openai

from tests.support.server_helpers import ServerProcess
from tripod.server.response_store import MemoryResponseStore, SqliteResponseStore, StoredResponse

BODY = {"id": "x", "output": [{"type": "message", "content": [{"type": "output_text", "text": "y" * 400}]}]}


def stores() -> None:
    m = MemoryResponseStore(1000, 10**6, 3600)
    t = time.perf_counter()
    for i in range(20000):
        m.put(StoredResponse(f"r{i}", "t", BODY, [], None, 0.0))
    dt = time.perf_counter() - t
    print(f"memory store: 20000 puts, {dt / 20000 * 1e6:.0f} us/put; {len(m)} records, {m.bytes} bytes")
    s = SqliteResponseStore(str(Path(tempfile.mkdtemp()) / "r.db"), 3600)
    t = time.perf_counter()
    for i in range(300):
        s.put(StoredResponse(f"r{i}", "t", BODY, [], None, 0.0))
    put = (time.perf_counter() - t) / 300
    t = time.perf_counter()
    for i in range(300):
        s.get(f"r{i}", "t")
    print(f"sqlite store (WAL, synchronous=FULL): {put * 1e3:.2f} ms/put, {(time.perf_counter() - t) / 300 * 1e3:.3f} ms/get")


def embeddings() -> None:
    srv = ServerProcess(Path(tempfile.mkdtemp()), "--model", "all-minilm-l6-v2")
    try:
        c = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0, timeout=120)
        texts = [f"sentence number {i} about retrieval and embeddings in tripod" for i in range(64)]
        c.embeddings.create(model="default", input=texts[:4])  # warm-up
        t = time.perf_counter()
        c.embeddings.create(model="default", input=texts)
        batched = time.perf_counter() - t
        t = time.perf_counter()
        for x in texts[:16]:
            c.embeddings.create(model="default", input=x)
        one = (time.perf_counter() - t) / 16
        print(f"MiniLM: 64 texts in one request {batched * 1e3:.0f} ms ({batched / 64 * 1e3:.1f} ms/text); "
              f"one text per request {one * 1e3:.1f} ms")
    finally:
        srv.stop()


if __name__ == "__main__":
    stores()
    embeddings()
