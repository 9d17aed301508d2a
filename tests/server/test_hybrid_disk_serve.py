"""A hybrid model (tiny random Qwen3.5) through real ``tripod serve --kv-disk`` processes and a
restart: the second server on the directory resumes the first one's conversation from the state
snapshot on disk (``usage.prompt_tokens_details.cached_tokens`` = the first turn's prompt + answer
but its last token, through the official ``openai`` client) and still answers with transformers'
greedy tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from tests.conftest import HFReference, check_greedy_tokens
from tests.models.test_hybrid_gdn import VOCAB, build_qwen3_5
from tests.support.server_helpers import ServerProcess
from tests.support.tiny_models import save

N = 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory, hf_tokenizer: Any) -> tuple[Path, HFReference]:
    model = build_qwen3_5()
    folder = save(model, tmp_path_factory.mktemp("qwen3_5_disk_serve"), hf_tokenizer)
    return folder, HFReference(model)


@pytest.mark.slow
def test_a_restarted_hybrid_server_resumes_from_the_disk_snapshot(checkpoint: tuple[Path, HFReference],
                                                                  tmp_path: Path) -> None:
    folder, ref = checkpoint
    g = torch.Generator().manual_seed(5)
    first = torch.randint(3, VOCAB, (40,), generator=g).tolist()
    follow_up = torch.randint(3, VOCAB, (7,), generator=g).tolist()
    args = ("--model", str(folder), "--kv-disk", str(tmp_path / "kv"), "--kv-disk-size", "1")

    def complete(srv: ServerProcess, prompt: list[int]) -> Any:
        oai = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120)
        return oai.completions.create(model=oai.models.list().data[0].id, prompt=prompt, max_tokens=N, temperature=0,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})

    srv = ServerProcess(tmp_path, *args)
    try:
        answer = complete(srv, first).choices[0].model_extra["token_ids"]
        check_greedy_tokens(answer, ref.greedy(first, N), "turn 1")
    finally:
        srv.stop()  # SIGTERM: the engine saves its tree, snapshots included, to the tier
    assert list((tmp_path / "kv").glob("*/??/*.st")), "the first server left its state snapshots on disk"

    srv = ServerProcess(tmp_path, *args)
    try:
        second = first + answer + follow_up
        r = complete(srv, second)
        assert r.usage.prompt_tokens_details.cached_tokens == len(first) + N - 1
        check_greedy_tokens(r.choices[0].model_extra["token_ids"], ref.greedy(second, N), "turn 2 (from disk)")
        stats = srv.wait_idle()
        assert stats["kv_disk"]["hit_tokens"] == len(first) + N - 1 and stats["consistent"] is True
        assert stats["states"]["snapshots_restored"] == 1
    finally:
        srv.stop()
