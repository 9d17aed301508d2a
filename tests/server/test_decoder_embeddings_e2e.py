"""A decoder served as an embedder, end to end: ``tripod serve --model DIR --task embed --pooling
mean`` on a tiny random Qwen3 checkpoint (saved by transformers), asked through the official
``openai`` client. The vectors equal transformers' pooled ``last_hidden_state`` to 1e-5, alone and
batched, with prefill chunks (8 tokens) shorter than the inputs; ``dimensions`` and base64 work as
on an encoder; generation is refused; the inputs' tokens are prompt tokens in ``/metrics`` and
against a tenant's ``input_tokens_per_minute``."""

from __future__ import annotations

import base64
import struct
from typing import Any

import httpx
import openai
import pytest
import torch
import torch.nn.functional as F

from tests.support.server_helpers import ServerProcess, metric_sum
from tests.support.tiny_models import VOCAB, build_hf, save

G = torch.Generator().manual_seed(5)
INPUTS = [torch.randint(3, VOCAB, (n,), generator=G).tolist() for n in (29, 5, 17)]
pytestmark = pytest.mark.slow  # a served tiny checkpoint: about 30 s (tests/engine covers the parity)
TENANTS = """
[[tenant]]
name = "free"
keys = ["sk-free"]

[[tenant]]
name = "meter"
keys = ["sk-meter"]
input_tokens_per_minute = 40
"""


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, hf_tokenizer: Any) -> Any:
    from transformers import AutoModel

    tmp = tmp_path_factory.mktemp("embed")
    folder = save(build_hf("qwen3"), tmp / "qwen3", hf_tokenizer)
    ref = AutoModel.from_pretrained(str(folder), dtype=torch.float32).eval()
    (tmp / "tenants.toml").write_text(TENANTS)
    srv = ServerProcess(tmp, "--model", str(folder), "--dtype", "float32", "--task", "embed", "--pooling", "mean",
                        "--chunk-size", "8", "--max-batch-tokens", "16", "--max-running", "4", "--threads", "1",
                        "--kv-cache-tokens", "1024", "--tenants", str(tmp / "tenants.toml"))
    try:
        yield srv, ref
    finally:
        srv.stop()


def client(srv: Any, key: str = "sk-free") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key=key, max_retries=0, timeout=120)


def mean_pooled(ref: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return F.normalize(ref(torch.tensor([ids])).last_hidden_state[0].mean(0), dim=-1)


def test_served_vectors_equal_transformers(served: Any) -> None:
    srv, ref = served
    oai = client(srv)
    model = oai.models.list().data[0].id
    want = [mean_pooled(ref, ids) for ids in INPUTS]
    before = metric_sum(srv.url, "tripod:prompt_tokens_total")
    batched = oai.embeddings.create(model=model, input=INPUTS)
    assert batched.usage.prompt_tokens == sum(len(x) for x in INPUTS)
    alone = [oai.embeddings.create(model=model, input=[ids]).data[0].embedding for ids in INPUTS]
    for i, w in enumerate(want):
        for what, got in (("batched", batched.data[i].embedding), ("alone", alone[i])):
            diff = (torch.tensor(got) - w).abs().max().item()
            assert diff < 1e-5, f"input {i} {what}: {diff} from transformers'"
    assert metric_sum(srv.url, "tripod:prompt_tokens_total") - before == 2 * batched.usage.prompt_tokens

    cut = oai.embeddings.create(model=model, input=[INPUTS[0]], dimensions=16).data[0].embedding
    assert torch.allclose(torch.tensor(cut), F.normalize(want[0][:16], dim=-1), atol=1e-5)
    raw = httpx.post(f"{srv.url}/v1/embeddings", headers={"Authorization": "Bearer sk-free"}, timeout=60,
                     json={"input": INPUTS[1], "encoding_format": "base64"}).json()["data"][0]["embedding"]
    decoded = struct.unpack(f"<{len(want[1])}f", base64.b64decode(raw))
    assert torch.allclose(torch.tensor(decoded), want[1], atol=1e-5)


def test_generation_and_bad_input_refused(served: Any) -> None:
    srv, _ = served
    oai = client(srv)
    with pytest.raises(openai.BadRequestError, match="task embed"):
        oai.chat.completions.create(model="default", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    with pytest.raises(openai.BadRequestError) as e:
        oai.embeddings.create(model="default", input=[[VOCAB + 5]])
    assert e.value.body["param"] == "input"
    with pytest.raises(openai.BadRequestError) as e:
        oai.embeddings.create(model="default", input=[INPUTS[0]], dimensions=10_000)
    assert e.value.body["param"] == "dimensions"
    assert httpx.get(f"{srv.url}/health", timeout=10).status_code == 200


def test_embedding_tokens_count_against_the_tenant(served: Any) -> None:
    srv, _ = served
    oai = client(srv, "sk-meter")
    before = metric_sum(srv.url, "tripod:tenant_prompt_tokens_total", tenant="meter")
    oai.embeddings.create(model="default", input=[INPUTS[0]])  # 29 of the 40 a minute
    with pytest.raises(openai.RateLimitError, match="input_tokens_per_minute"):
        oai.embeddings.create(model="default", input=[INPUTS[2]])  # 17 more: over
    with pytest.raises(openai.BadRequestError) as e:  # more than the limit alone: never
        oai.embeddings.create(model="default", input=[INPUTS[0] + INPUTS[2]])
    assert e.value.body["param"] == "input"
    assert metric_sum(srv.url, "tripod:tenant_prompt_tokens_total", tenant="meter") - before == len(INPUTS[0])
