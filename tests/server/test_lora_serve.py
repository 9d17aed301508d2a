"""LoRA adapters through a real ``tripod serve --lora NAME=PATH`` with the official ``openai``
client: ``/v1/models`` lists the base and each adapter (``parent``: the base); the ``model`` field
picks the adapter and the tokens are PEFT's; adapters load and unload live (vLLM's endpoints,
behind the API key) while requests stream, an unload answering once the adapter's running
requests are done; bad adapters and unknown names get 4xx saying why."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest
import torch

from tests.conftest import HFReference
from tests.support.lora_adapters import make_adapter, other_llama, random_adapter
from tests.support.server_helpers import ServerProcess
from tests.support.tiny_models import VOCAB, build_hf, save

N = 12
KEY = "sk-lora"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, hf_tokenizer: Any) -> Any:
    tmp = tmp_path_factory.mktemp("lora-serve")
    base = build_hf("llama", seed=3)
    folder = save(base, tmp / "base", hf_tokenizer)
    paths = {k: tmp / k for k in ("attn", "mlp")}
    refs = {None: HFReference(base), **{k: HFReference(make_adapter(base, k, p, seed=20 + i))
                                        for i, (k, p) in enumerate(paths.items())}}
    make_adapter(other_llama(), "attn", tmp / "wrong", seed=5)
    srv = ServerProcess(tmp, "--model", str(folder), "--threads", "1", "--kv-cache-tokens", "4096",
                        "--lora", f"attn={paths['attn']}", "--max-loras", "2", api_key=KEY)
    yield srv, paths, refs, tmp
    srv.stop()


def _prompt(seed: int) -> list[int]:
    return torch.randint(3, VOCAB, (20,), generator=torch.Generator().manual_seed(seed)).tolist()


def _complete(oai: openai.OpenAI, model: str, prompt: list[int], **kw: Any) -> list[int]:
    r = oai.completions.create(model=model, prompt=prompt, max_tokens=N, temperature=0,
                               extra_body={"ignore_eos": True, "return_token_ids": True}, **kw)
    return r.choices[0].model_extra["token_ids"]


@pytest.mark.slow  # (moved out of the default run: CI runs it)
def test_adapters_served_live(served: Any) -> None:
    srv, paths, refs, tmp = served
    oai = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=KEY, max_retries=0, timeout=120)
    cards = {m.id: m for m in oai.models.list().data}
    base = next(i for i, m in cards.items() if not m.model_extra.get("parent"))
    assert set(cards) == {base, "attn"} and cards["attn"].model_extra["parent"] == base
    p = _prompt(1)
    assert _complete(oai, "attn", p) == refs["attn"].greedy(p, N).tokens
    assert _complete(oai, base, p) == refs[None].greedy(p, N).tokens
    with pytest.raises(openai.NotFoundError, match="mlp"):
        _complete(oai, "mlp", p)

    admin = httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
    assert httpx.post(f"{srv.url}/v1/load_lora_adapter", json={"lora_name": "mlp", "lora_path": str(paths["mlp"])}
                      ).status_code == 401  # behind the API key
    r = admin.post("/v1/load_lora_adapter", json={"lora_name": "mlp", "lora_path": str(paths["mlp"])})
    assert r.status_code == 200, r.text
    assert {m.id for m in oai.models.list().data} == {base, "attn", "mlp"}
    assert _complete(oai, "mlp", p) == refs["mlp"].greedy(p, N).tokens
    bad = admin.post("/v1/load_lora_adapter", json={"lora_name": "wrong", "lora_path": str(tmp / "wrong")})
    assert bad.status_code == 400 and "do not fit the base model" in bad.json()["error"]["message"]
    assert admin.post("/v1/load_lora_adapter", json={"lora_name": "x"}).status_code == 400  # no lora_path

    # Unload "mlp" while a long streamed answer of it runs: the stream completes on its weights,
    # the unload answers after it, and later requests for "mlp" are refused.
    long_p = _prompt(2)
    want = refs["mlp"].greedy(long_p, 200).tokens
    got: list[int] = []
    started = threading.Event()

    def stream() -> None:
        s = oai.completions.create(model="mlp", prompt=long_p, max_tokens=200, temperature=0, stream=True,
                                   extra_body={"ignore_eos": True, "return_token_ids": True})
        for chunk in s:
            if chunk.choices:
                got.extend(chunk.choices[0].model_extra.get("token_ids") or [])
                started.set()

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(60)
    r = admin.post("/v1/unload_lora_adapter", json={"lora_name": "mlp"})
    # (200 tokens stream far longer than an unload's round trip: the stream was running)
    assert r.status_code == 200 and r.json()["waited_for"] == 1 and r.json()["running"] == 0
    t.join(120)
    assert got == want
    with pytest.raises(openai.NotFoundError):
        _complete(oai, "mlp", p)
    assert admin.post("/v1/unload_lora_adapter", json={"lora_name": "mlp"}).status_code == 404
    assert _complete(oai, "attn", p) == refs["attn"].greedy(p, N).tokens  # the other adapter is untouched


@pytest.mark.slow
def test_adapter_on_the_embedded_model_through_every_surface(tmp_path: Path) -> None:
    """A random adapter of the embedded SmolLM2 (real tokenizer and chat template): the Anthropic
    client and the OpenAI chat API answer alike on it (and unlike the base), a JSON schema
    constrains its answer, and n-gram drafts verified by the adapted model change nothing."""
    from tripod.loader import load_tokenizer

    cfg = load_tokenizer(None).config
    path = random_adapter(tmp_path / "rnd", cfg, rank=8, seed=1)
    srv = ServerProcess(tmp_path, "--lora", f"rnd={path}", "--speculative", "ngram", "--threads", "1")
    try:
        oai = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120)
        claude = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0, timeout=120)
        base = next(m.id for m in oai.models.list().data if not m.model_extra.get("parent"))
        msgs = [{"role": "user", "content": "Name three colours of the rainbow."}]

        def chat(model: str, **kw: Any) -> str:
            r = oai.chat.completions.create(model=model, messages=msgs, max_tokens=24, temperature=0, **kw)
            return r.choices[0].message.content or ""

        adapted = chat("rnd")
        assert adapted != chat(base), "the adapter changed nothing"
        m = claude.messages.create(model="rnd", messages=msgs, max_tokens=24, extra_body={"temperature": 0})  # type: ignore[arg-type]
        assert m.content[0].text == adapted
        assert chat("rnd", extra_body={"speculative": False}) == adapted  # drafts verified by the adapted model
        schema = {"type": "object", "properties": {"colour": {"type": "string"}}, "required": ["colour"],
                  "additionalProperties": False}
        answer = chat("rnd", response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}})
        jsonschema.validate(json.loads(answer), schema)
    finally:
        srv.stop()
