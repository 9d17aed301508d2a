"""A prompt's prefill computes logits only where a token is sampled: the lm head sees one row per
prompt (its last position) and is not called for the chunks before it (prompt logprobs have their
own scoring pass, ``engine/prompt_logprobs.py``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tripod import SamplingParams


class HeadRecorder:
    """Wraps one lm head op and records the number of rows of each call."""

    def __init__(self, op: Any) -> None:
        self.op = op
        self.rows: list[int] = []

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.rows.append(int(x.shape[0]))
        return self.op(x)


def _record_head(eng: Any, monkeypatch: pytest.MonkeyPatch) -> HeadRecorder:
    model = eng.runner.model
    form = eng.runner.backend.form  # (prepares the head of this form)
    rec = HeadRecorder(model.head_ops[form])
    monkeypatch.setitem(model.head_ops, form, rec)
    return rec


def test_chunked_prefill_runs_the_lm_head_once_on_the_last_position(
    make_engine: Any, chat: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    chunked = make_engine(chunk_size=16, max_batch_tokens=32, max_running=4)
    whole = make_engine(enable_prefix_cache=False)
    prompt = chat("Tell me about the rare maps room, the café and the opening hours on weekdays, in a few short words please.")
    assert len(prompt) > 3 * 16, "the prompt should take several chunks"
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    rec = _record_head(chunked, monkeypatch)
    out = chunked.generate([prompt], params)[0]
    # ceil(len/16) prefill steps, then one decode step per further token: the head ran once per
    # sampled token, on one row each time (the non-final chunks skipped it).
    assert rec.rows == [1, 1, 1]
    assert chunked.stats.steps == -(-len(prompt) // 16) + 2
    # ... and the tokens are those of the prompt computed in one chunk, without the cache.
    assert list(out.token_ids) == list(whole.generate([prompt], params)[0].token_ids)
    chunked.assert_consistent()

