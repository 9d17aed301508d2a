"""A prompt's KV exported by one engine (a prefill replica's ``Engine.export_kv``) and received into
another's disk tier (``BlockReceiver``: what a decode replica's ``/v1/pd/kv`` does), on the real
embedded model in float32: both engines name the same identity, the receiving engine loads the
exact rows the exporter computed and answers with the same greedy tokens."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tripod import SamplingParams
from tripod.memory.kv_transfer import BlockReceiver

TEXT = ("The ferry to the outer islands leaves the north pier at eight, noon and five. Bicycles travel free, "
        "cars must be booked a day ahead, and dogs ride on the open deck only. In winter the noon sailing is "
        "cancelled when the wind passes force seven, and the harbour office posts notices by the ticket window. "
        "Return tickets are valid for a month and can be changed at no cost up to an hour before sailing.")


def _rows(engine: Any, tokens: list[int]) -> torch.Tensor:
    slots = engine.cache.match_prefix(tokens, record=False).slots
    assert len(slots) >= len(tokens)
    return engine.pool.kv[:, torch.tensor(slots[: len(tokens)])].clone()


def test_exported_kv_lands_as_the_same_rows_and_tokens(make_engine: Callable[..., Any], tmp_path: Path) -> None:
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prefill, decode = make_engine(), make_engine(kv_disk=str(tmp_path))
    try:
        prompt = list(prefill.tokenizer.encode(TEXT))
        want = prefill.generate([prompt], params)[0]
        assert want.cached_tokens == 0
        blocks = prefill.export_kv(prompt)
        assert len(blocks) == len(prompt) // 16 and blocks[0] == prefill.export_kv(prompt[:16])[0]
        assert prefill.kv_layout.identity == decode.kv_layout.identity, "one identity, computed either way"

        rx = BlockReceiver(decode.kv_layout, decode.cache.tier.dir)
        rx.feed(b"".join(blocks))
        assert rx.counts.blocks == len(blocks) and rx.leftover == 0

        got = decode.generate([prompt], params)[0]
        usable = (len(prompt) - 1) // 16 * 16  # whole blocks of all but the last prompt token
        assert got.cached_tokens == usable and decode.cache.tier_stats.hit_tokens == usable
        assert got.token_ids == want.token_ids
        assert torch.equal(_rows(decode, prompt[:usable]), _rows(prefill, prompt[:usable]))
        assert prefill.export_kv(list(range(7))) == []  # nothing cached: nothing to send
        decode.assert_consistent()
    finally:
        prefill.close()
        decode.close()
