"""A hybrid model's state snapshots through the disk tier and the KV transfer (issue 46, item 3).

A tiny random Qwen3.5 (Gated DeltaNet + gated attention, from transformers' config) runs with
``--kv-disk``: prefixes evicted from memory (or saved at shutdown) go to disk with their state
snapshots, and a later prompt that extends them resumes from the disk snapshot, skipping exactly
``cached_tokens``; its tokens and logprobs are those of an engine with the cache off, bit for bit on
the CPU kernels. A file of the older block format (version 2) is refused and written again. A
prefill engine's export (blocks + snapshot) received into a decode engine's tier resumes the
request there exactly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.conftest import HFReference
from tests.models.test_hybrid_gdn import N_TOKENS, PARAMS, PROMPTS, build_qwen3_5
from tripod import Engine, SamplingParams
from tripod.memory.kv_blocks import HEADER, MAGIC, OLD_HEADER
from tripod.memory.kv_transfer import BlockReceiver


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, HFReference]:
    model = build_qwen3_5()
    folder = tmp_path_factory.mktemp("qwen3_5_disk")
    model.save_pretrained(str(folder))
    return folder, HFReference(model)


def _engine(folder: Path, **kw: Any) -> Engine:
    args: dict[str, Any] = dict(dtype="float32", kv_cache_tokens=1024, chunk_size=8, max_batch_tokens=32,
                                max_running=4, kernels="optimized")
    return Engine(model=str(folder), **{**args, **kw})


def _same(got: Any, want: Any, bitwise: bool) -> None:
    assert got.token_ids == want.token_ids
    if bitwise:
        assert [lp.logprob for lp in got.logprobs] == [lp.logprob for lp in want.logprobs]


def test_evicted_snapshot_hits_from_disk_and_survives_a_restart(qwen3_5: tuple[Path, HFReference],
                                                                 tmp_path: Path) -> None:
    folder, _ = qwen3_5
    fresh = _engine(folder, enable_prefix_cache=False)
    eng = _engine(folder, kv_disk=str(tmp_path))
    p = PROMPTS[0]
    (first,) = eng.generate([p], PARAMS)
    turn = p + first.token_ids + PROMPTS[1]  # an agent's next turn extends prompt + answer
    at = len(p) + N_TOKENS - 1  # where the finished request's snapshot is (its last token never computed)
    eng.cache.reset()  # everything out of memory: blocks and snapshots to disk
    assert eng.cache.total_size == 0 and eng.cache.tier.flush(30)
    tier = eng.cache.tier
    assert tier.snapshot_entries >= 2 and tier.counters.written_snapshots == tier.snapshot_entries
    (hit,) = eng.generate([turn], PARAMS)
    assert hit.cached_tokens == at, "resumed from the disk snapshot of the previous turn's end"
    assert eng.cache.tier_stats.loaded_snapshots == 1 and eng.cache.tier_stats.hit_tokens == at
    (want,) = fresh.generate([turn], PARAMS)
    bitwise = eng.runner.uses_kernels
    _same(hit, want, bitwise)
    eng.assert_consistent()
    eng.close()  # the tree and its snapshots saved: a restart finds them

    again = _engine(folder, kv_disk=str(tmp_path))
    try:
        longer = turn + hit.token_ids + PROMPTS[2]
        (got,) = again.generate([longer], PARAMS)
        assert got.cached_tokens == len(turn) + N_TOKENS - 1
        (want,) = fresh.generate([longer], PARAMS)
        _same(got, want, bitwise)
        again.assert_consistent()
    finally:
        again.close()


def test_an_older_format_file_is_refused_and_written_again(qwen3_5: tuple[Path, HFReference], tmp_path: Path) -> None:
    folder, _ = qwen3_5
    eng = _engine(folder, kv_disk=str(tmp_path))
    p = PROMPTS[0]
    (first,) = eng.generate([p], PARAMS)
    eng.close()
    turn = p + first.token_ids
    files = sorted((tmp_path).rglob("*.kv"))
    assert files
    for f in files:  # every KV block as version 2 wrote it (no version byte, no state section)
        data = f.read_bytes()
        assert data.startswith(MAGIC)
        _, ident, key, ntok, nbytes, _, crc = HEADER.unpack_from(data)
        f.write_bytes(OLD_HEADER.pack(b"TPKVBLK2", ident, key, ntok, nbytes, crc) + data[HEADER.size :])
    again = _engine(folder, kv_disk=str(tmp_path))
    try:
        (got,) = again.generate([turn], PARAMS)
        tier = again.cache.tier
        assert tier.counters.old_format_files >= 1 and got.cached_tokens == 0, "an old block is never served"
        (want,) = _engine(folder, enable_prefix_cache=False).generate([turn], PARAMS)
        _same(got, want, again.runner.uses_kernels)
    finally:
        again.close()
    rewritten = [f for f in files if f.exists()]
    assert rewritten and all(f.read_bytes().startswith(MAGIC) for f in rewritten), "written again, version 3"


def test_exported_snapshot_resumes_the_request_on_another_engine(qwen3_5: tuple[Path, HFReference],
                                                                 tmp_path: Path) -> None:
    folder, _ = qwen3_5
    prefill = _engine(folder)
    decode = _engine(folder, kv_disk=str(tmp_path))
    try:
        prompt = PROMPTS[0] + PROMPTS[2]  # 59 tokens: 3 whole blocks and a tail
        # What a prefill replica does (server/api/pd.py): the prompt but its last token, one token.
        prefill.generate([prompt[:-1]], SamplingParams(max_tokens=1, temperature=0.0))
        blocks = prefill.export_kv(prompt)
        assert len(blocks) == (len(prompt) - 1) // 16 + 1, "the whole blocks, then the snapshot block"
        assert prefill.kv_layout == decode.kv_layout and decode.kv_layout.state_bytes > 0
        rx = BlockReceiver(decode.kv_layout, decode.cache.tier.dir)
        rx.feed(b"".join(blocks))
        assert rx.counts.blocks == len(blocks) and rx.leftover == 0
        (got,) = decode.generate([prompt], PARAMS)
        assert got.cached_tokens == len(prompt) - 1
        (want,) = _engine(folder, enable_prefix_cache=False).generate([prompt], PARAMS)
        _same(got, want, decode.runner.uses_kernels)
        decode.assert_consistent()
        assert prefill.export_kv(list(range(3, 10))) == []  # no snapshot: nothing to send
    finally:
        prefill.close()
        decode.close()
