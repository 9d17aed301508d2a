"""LoRA in a fleet (``tripod serve --replicas 2 --lora attn=PATH``): every replica serves the
adapter from the start; an adapter loaded through the router reaches every replica (each answers
with PEFT's tokens) and an unload through it removes it everywhere."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from tests.conftest import HFReference
from tests.support.lora_adapters import make_adapter
from tests.support.server_helpers import TripodProcess
from tests.support.tiny_models import VOCAB, build_hf, save

N = 10


@pytest.mark.slow  # (two replicas start: ~45 s; the single server's adapters are in the default run)
def test_fleet_serves_and_loads_adapters_on_every_replica(tmp_path: Path, hf_tokenizer: Any) -> None:
    base = build_hf("llama", seed=3)
    folder = save(base, tmp_path / "llama", hf_tokenizer)
    refs = {k: HFReference(make_adapter(base, k, tmp_path / k, seed=30 + i)) for i, k in enumerate(("attn", "mlp"))}
    fleet = TripodProcess(tmp_path, "serve", "--model", str(folder), "--replicas", "2", "--dtype", "float32",
                          "--kernels", "eager", "--kv-cache-tokens", "2048", "--health-interval", "0.2",
                          "--lora", f"attn={tmp_path / 'attn'}", "--replica-log-dir", str(tmp_path), start_timeout=300)
    try:
        fleet.wait_for("2 healthy replicas", lambda f: sum(r["state"] == "healthy" for r in f["replicas"]) >= 2, 300)
        oai = openai.OpenAI(base_url=fleet.url + "/v1", api_key="none", max_retries=0, timeout=120)
        r = httpx.post(fleet.url + "/v1/load_lora_adapter", json={"lora_name": "mlp", "lora_path": str(tmp_path / "mlp")},
                       timeout=120)
        assert r.status_code == 200, r.text
        assert set(r.json()["replicas"]) == {rep["name"] for rep in fleet.fleet()["replicas"]}
        for rep in fleet.fleet()["replicas"]:  # each replica itself now lists both adapters
            ids = {m["id"] for m in httpx.get(rep["url"] + "/v1/models", timeout=10).json()["data"]}
            assert {"attn", "mlp"} <= ids
        g = torch.Generator().manual_seed(4)
        for i in range(4):  # different prompts: spread over both replicas
            p = torch.randint(3, VOCAB, (18 + i,), generator=g).tolist()
            for name in ("attn", "mlp"):
                out = oai.completions.create(model=name, prompt=p, max_tokens=N, temperature=0,
                                             extra_body={"ignore_eos": True, "return_token_ids": True})
                assert out.choices[0].model_extra["token_ids"] == refs[name].greedy(p, N).tokens
        r = httpx.post(fleet.url + "/v1/unload_lora_adapter", json={"lora_name": "mlp"}, timeout=120)
        assert r.status_code == 200, r.text
        bad = httpx.post(fleet.url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path)},
                         timeout=120)
        assert bad.status_code == 400 and "2 of 2 replicas refused" in bad.json()["error"]["message"]
    finally:
        fleet.stop()
