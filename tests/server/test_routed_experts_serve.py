"""``return_routed_experts`` through a real ``tripod serve --enable-rl-api`` on a tiny random
Qwen3-MoE: each choice's ``routed_experts`` equal transformers' router top-k for the tokens it
computed (its prompt and its output but the last token), the same alone and batched; streaming it
is refused with a 400 saying what to change."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import torch

from tests.support.server_helpers import ServerProcess
from tests.support.tiny_models import VOCAB, build_hf, save


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory, hf_tokenizer: Any) -> Any:
    tmp = tmp_path_factory.mktemp("routed")
    hf = build_hf("qwen3-moe")
    srv = ServerProcess(tmp, "--model", str(save(hf, tmp / "m", hf_tokenizer)), "--dtype", "float32",
                        "--threads", "1", "--enable-rl-api")
    yield srv, hf
    srv.stop()


def _hf_topk(model: Any, ids: list[int]) -> list[list[list[int]]]:
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_router_logits=True)
    k = model.config.num_experts_per_tok
    return torch.stack([lg.reshape(len(ids), -1).topk(k, dim=-1).indices for lg in out.router_logits], dim=1).tolist()


@pytest.mark.slow  # (moved out of the default run: CI runs it)
def test_routed_experts_alone_batched_and_against_transformers(moe: Any) -> None:
    srv, hf = moe
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (13, 6)]
    http = httpx.Client(base_url=srv.url, timeout=120)
    body = {"model": "m", "max_tokens": 5, "temperature": 0, "ignore_eos": True, "return_token_ids": True,
            "return_routed_experts": True}

    def choices(prompt: Any) -> list[dict[str, Any]]:
        r = http.post("/v1/completions", json={**body, "prompt": prompt})
        assert r.status_code == 200, r.text
        return list(r.json()["choices"])

    alone = [choices(p)[0] for p in prompts]
    batched = choices(prompts)
    for p, a, b in zip(prompts, alone, batched, strict=True):
        assert a["routed_experts"] == _hf_topk(hf, p + a["token_ids"][:-1])
        assert b["token_ids"] == a["token_ids"] and b["routed_experts"] == a["routed_experts"]
    r = http.post("/v1/completions", json={**body, "prompt": prompts[0], "return_routed_experts": False})
    assert r.status_code == 200 and "routed_experts" not in r.json()["choices"][0]
    r = http.post("/v1/completions", json={**body, "prompt": prompts[0], "stream": True})
    assert r.status_code == 400 and "stream" in r.text, r.text
