"""Prefill/decode replicas started by hand behind ``tripod route``, with a
combination that cannot work: the prefill replica computes on another path (``--kernels eager``)
than the decode replica (``--kernels optimized``), so their KV identities differ. The decode replica
refuses the blocks (409 ``kv_transfer_refused``), the router logs it as an error and counts it
``refused``, and the request is answered by the decode replica prefilling itself: the right answer."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from tests.support.server_helpers import ServerProcess, TripodProcess

SYSTEM = "You are the depot's dispatcher. " + ("Fragile parcels ride in the front cage; cold goods in blue boxes. " * 6)


@pytest.fixture(scope="module")
def route(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TripodProcess, ServerProcess, ServerProcess]]:
    tmp: Path = tmp_path_factory.mktemp("pd-route")
    with ThreadPoolExecutor(2) as pool:
        pre_f = pool.submit(ServerProcess, tmp, "--role", "prefill", "--kernels", "eager", "--threads", "1")
        dec_f = pool.submit(ServerProcess, tmp, "--role", "decode", "--threads", "1")
        prefill, decode = pre_f.result(), dec_f.result()
    router = TripodProcess(tmp, "route", "--replica", prefill.url, "--replica", decode.url, "--health-interval", "0.2",
                           start_timeout=60)
    router.wait_for("both replicas with their roles", lambda f: sorted(
        r["role"] for r in f["replicas"] if r["state"] == "healthy") == ["decode", "prefill"], 30)
    yield router, prefill, decode
    router.stop()
    prefill.stop()
    decode.stop()


@pytest.mark.slow
def test_mismatched_identities_are_refused_and_the_answer_is_still_right(
        route: tuple[TripodProcess, ServerProcess, ServerProcess]) -> None:
    router, _prefill, decode = route
    body = {"model": "default", "max_tokens": 10, "temperature": 0,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Where do cold goods go?"}]}
    got = OpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0).chat.completions.create(**body)
    pd = router.fleet()["pd"]
    assert pd["refused"] == 1 and pd["ok"] == 0, pd
    assert "refused" in router.log() and "identity" in router.log()
    assert got.usage.prompt_tokens_details.cached_tokens == 0, "nothing of the other identity was used"
    want = httpx.post(decode.url + "/v1/chat/completions", json=body, timeout=120).json()
    assert got.choices[0].message.content == want["choices"][0]["message"]["content"]
    metrics = httpx.get(decode.url + "/metrics", timeout=10).text
    assert any(line.startswith("tripod:pd_kv_receives_total{") and 'outcome="refused"' in line and
               line.endswith(" 1.0") for line in metrics.splitlines()), metrics
