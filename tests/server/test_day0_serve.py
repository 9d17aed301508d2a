"""The day-0 architectures through a real ``tripod serve --model DIR``: DeepSeek-V4 (compressed
attention, hyper-connections), DeepSeek-V3.2 (sparse MLA) and gpt-oss (sinks, alternating windows),
each a tiny random checkpoint saved by transformers. The official ``openai`` client's greedy
completion (whole and streamed) carries transformers' tokens, and ``/v1/models`` names the
architecture."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from tests.conftest import HFReference
from tests.support.server_helpers import ServerProcess
from tests.support.tiny_models import VOCAB, build_hf, save

pytestmark = pytest.mark.slow  # three tiny checkpoints served: about 15 s (tests/models covers the parity)

N = 16


@pytest.mark.parametrize("kind", ["deepseek-v4", "deepseek-v32", "gpt-oss"])
def test_served_greedy_matches_transformers(kind: str, tmp_path: Path, hf_tokenizer: Any) -> None:
    model = build_hf(kind)
    folder = save(model, tmp_path / kind, hf_tokenizer)
    prompt = torch.randint(3, VOCAB, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    want = HFReference(model).greedy(prompt, N).tokens
    srv = ServerProcess(tmp_path, "--model", str(folder), "--threads", "1", "--kv-cache-tokens", "2048")
    try:
        oai = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120)
        card = oai.models.list().data[0]
        assert card.model_extra["architecture"] == model.config.architectures[0]
        kw: dict[str, Any] = dict(model=card.id, prompt=prompt, max_tokens=N, temperature=0,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
        r = oai.completions.create(**kw)
        assert r.choices[0].model_extra["token_ids"] == want, f"{kind}: served tokens differ from transformers'"
        streamed = [c.choices[0].model_extra.get("token_ids") or [] for c in oai.completions.create(stream=True, **kw)
                    if c.choices]
        assert [t for ids in streamed for t in ids] == want
    finally:
        srv.stop()
