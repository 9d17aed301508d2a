"""The prefix cache's disk tier (``--kv-disk``) on the real embedded model, in float32: a prefix
loaded from disk is the same KV, bit for bit, as the one computed, and gives the same greedy tokens;
a restart and a second engine on the directory find it; torn files are never served; another model
or dtype has other keys."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tripod import SamplingParams
from tripod.memory.kv_blocks import BLOCK_TOKENS, chain_keys, model_identity

POOL = 256  # slots: one prompt and its answer fit, two do not

TEXT_P = (
    "The lighthouse keeper kept a log of every ship that passed the northern point. In the spring the "
    "fishing boats came first, then the cargo steamers with coal and timber, and in the late summer the "
    "tall sailing ships that carried wool to the southern ports. He wrote down the name of each vessel, "
    "the hour, the weather and the state of the sea, and on quiet nights he added notes about the birds "
    "that rested on the gallery rail, the colour of the sky before a storm, and the letters he meant to "
    "write to his sister in the city. After forty years the logs filled a whole shelf of the tower room."
)
TEXT_Q = (
    "A small bakery on the corner of Mill Lane opens at six every morning. The baker starts the ovens at "
    "four, shapes the sourdough loaves that rose overnight, and sets out rye, spelt and a sweet braided "
    "bread on Fridays. Regulars know that the cinnamon rolls are gone by half past seven, that the soup of "
    "the day is written on a slate by the door, and that the old dog asleep under the counter is called "
    "Pepper. On the first Sunday of each month the bakery closes early so the staff can teach a free "
    "class on bread to the children of the neighbourhood, who take their own small loaf home afterwards."
)


def _params() -> SamplingParams:
    return SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def prompts(base_engine: Any) -> tuple[list[int], list[int]]:
    p = list(base_engine.tokenizer.encode(TEXT_P))
    q = list(base_engine.tokenizer.encode(TEXT_Q))
    assert 100 < len(p) < POOL - 20 and 100 < len(q) < POOL - 20
    assert len(p) + len(q) + 12 > POOL, "the second prompt must evict the first"
    return p, q


@pytest.fixture(scope="module")
def reference(base_engine: Any, prompts: tuple[list[int], list[int]]) -> Any:
    """P's greedy answer computed with no cache at all (a fresh pool)."""
    out = base_engine.generate([prompts[0]], _params())[0]
    base_engine.reset_prefix_cache()
    return out


def _blocks_of(tokens: list[int]) -> int:
    """Tokens of a prompt that the disk tier can serve: whole blocks of all but its last token."""
    return (len(tokens) - 1) // BLOCK_TOKENS * BLOCK_TOKENS


def _rows(engine: Any, tokens: list[int]) -> torch.Tensor:
    """The pool rows of ``tokens`` (read without a use: the tree is not split or touched)."""
    n, node = engine.cache.tree.match(tokens)
    slots = node.path_value()
    if len(slots) < n:
        slots += node.children[tokens[len(slots)]].value[: n - len(slots)]
    assert len(slots) == len(tokens)
    return engine.pool.kv[:, torch.tensor(slots)].clone()


def test_a_prefix_from_disk_is_the_computed_kv_and_gives_the_same_tokens(
    make_engine: Callable[..., Any], tmp_path: Path, prompts: tuple[list[int], list[int]], reference: Any,
    check_greedy: Any, greedy_from_tripod: Any,
) -> None:
    p, q = prompts
    eng = make_engine(kv_cache_tokens=POOL, kv_disk=str(tmp_path))
    try:
        first = eng.generate([p], _params())[0]
        assert first.cached_tokens == 0 and first.token_ids == reference.token_ids
        computed = _rows(eng, p[: _blocks_of(p)])
        eng.generate([q], _params())  # evicts p (written to disk on the way out)
        assert eng.cache.tier.flush(30)
        assert eng.cache.tree.match(p)[0] == 0, "p left the pool"
        assert eng.cache.tier_stats.saved_tokens >= _blocks_of(p)

        from_disk = eng.generate([p], _params())[0]
        assert from_disk.cached_tokens == _blocks_of(p)
        assert eng.cache.tier_stats.hit_tokens == _blocks_of(p)
        assert torch.equal(_rows(eng, p[: _blocks_of(p)]), computed), "loaded rows are the computed rows"
        check_greedy(from_disk.token_ids, greedy_from_tripod(reference), "prefix from disk vs computed")

        from_pool = eng.generate([p], _params())[0]  # now in the pool, whole
        assert from_pool.cached_tokens == len(p) - 1
        assert eng.cache.tier_stats.hit_tokens == _blocks_of(p), "a pool hit is not a disk hit"
        check_greedy(from_pool.token_ids, greedy_from_tripod(reference), "prefix from the pool vs computed")
        eng.assert_consistent()
    finally:
        eng.close()


def test_a_restart_serves_the_prefix_from_disk(
    make_engine: Callable[..., Any], tmp_path: Path, prompts: tuple[list[int], list[int]], reference: Any,
    check_greedy: Any, greedy_from_tripod: Any,
) -> None:
    p, _ = prompts
    eng = make_engine(kv_cache_tokens=POOL, kv_disk=str(tmp_path))
    eng.generate([p], _params())
    eng.close()  # saves what the pool holds
    again = make_engine(kv_cache_tokens=POOL, kv_disk=str(tmp_path))
    try:
        assert again.cache.tier.entries >= _blocks_of(p) // BLOCK_TOKENS
        out = again.generate([p], _params())[0]
        assert out.cached_tokens == _blocks_of(p) and again.cache.tier_stats.hit_tokens == _blocks_of(p)
        check_greedy(out.token_ids, greedy_from_tripod(reference), "after a restart")
        again.assert_consistent()
    finally:
        again.close()


def test_two_engines_on_one_directory_share_hits(
    make_engine: Callable[..., Any], tmp_path: Path, prompts: tuple[list[int], list[int]], reference: Any,
    check_greedy: Any, greedy_from_tripod: Any,
) -> None:
    p, _ = prompts
    a = make_engine(kv_cache_tokens=POOL, kv_disk=str(tmp_path))
    b = make_engine(kv_cache_tokens=POOL, kv_disk=str(tmp_path))  # open before a writes anything
    try:
        a.generate([p], _params())
        a.cache.save_tree()
        assert a.cache.tier.flush(30)
        out = b.generate([p], _params())[0]
        assert out.cached_tokens == _blocks_of(p) and b.cache.tier_stats.hit_tokens == _blocks_of(p)
        check_greedy(out.token_ids, greedy_from_tripod(reference), "from the other engine's blocks")
        b.cache.save_tree()
        assert b.cache.tier.flush(30)
        assert b.cache.tier.counters.written_blocks < _blocks_of(p) // BLOCK_TOKENS, "b rewrote a's blocks"
    finally:
        a.close()
        b.close()


def test_a_torn_block_is_never_served(
    make_engine: Callable[..., Any], tmp_path: Path, prompts: tuple[list[int], list[int]], reference: Any,
    check_greedy: Any, greedy_from_tripod: Any,
) -> None:
    p, _ = prompts
    eng = make_engine(kv_cache_tokens=POOL, kv_disk=str(tmp_path))
    eng.generate([p], _params())
    tier = eng.cache.tier
    eng.close()
    keys = chain_keys(tier.layout.identity, p, BLOCK_TOKENS)
    torn = tier.path(keys[4])
    torn.write_bytes(torn.read_bytes()[: torn.stat().st_size - 1000])  # a write cut short
    again = make_engine(kv_cache_tokens=POOL, kv_disk=str(tmp_path))
    try:
        out = again.generate([p], _params())[0]
        assert out.cached_tokens == 4 * BLOCK_TOKENS, "served up to the torn block, not past it"
        assert again.cache.tier.counters.corrupt_files == 1 and not torn.exists()
        check_greedy(out.token_ids, greedy_from_tripod(reference), "with a torn block")
        again.assert_consistent()
    finally:
        again.close()


def test_another_model_or_dtype_has_another_identity(base_engine: Any) -> None:
    e = base_engine

    def ident(model: torch.nn.Module = e.loaded.model, dtype: torch.dtype = e.dtype, pool: Any = e.pool) -> bytes:
        return model_identity(name=e.loaded.name, architecture=e.model_config.architecture, model=model, dtype=dtype,
                              pool=pool, extra={})

    same = ident()
    assert ident() == same
    assert ident(dtype=torch.bfloat16) != same
    bf16_pool = type(e.pool)(8, e.pool.kv.shape[0], e.pool.num_kv_heads, e.pool.head_dim, torch.bfloat16,
                             torch.device("cpu"))
    assert ident(pool=bf16_pool) != same
    tiny = torch.nn.Linear(4, 4)
    before = ident(model=tiny)
    with torch.no_grad():
        tiny.weight[0, 0] += 1.0  # a fine-tune: other weights
    assert ident(model=tiny) != before


def test_the_disk_tier_is_refused_with_tensor_parallel_and_without_the_prefix_cache(tmp_path: Path) -> None:
    from tripod.config import EngineConfig

    with pytest.raises(ValueError, match="--kv-disk is not built for a model over several processes"):
        EngineConfig(kv_disk=str(tmp_path), tensor_parallel_size=2).check_parallel()
    with pytest.raises(ValueError, match="--no-prefix-cache"):
        EngineConfig(kv_disk=str(tmp_path), enable_prefix_cache=False).check_parallel()


@pytest.mark.slow
def test_bfloat16_on_the_kernels_a_prefix_from_disk_gives_the_same_tokens(
    tmp_path: Path, prompts: tuple[list[int], list[int]],
) -> None:
    """The default dtype where tripod's kernels run (bfloat16): the loaded rows are the computed
    rows, and the greedy tokens after a disk hit are those computed without one."""
    from tripod import Engine, kernels

    if kernels.unavailable_reason() is not None:
        pytest.skip(f"tripod's CPU kernels unavailable: {kernels.unavailable_reason()}")
    p, q = prompts
    eng = Engine(dtype="bfloat16", kernels="optimized", kv_cache_tokens=POOL, kv_disk=str(tmp_path))
    try:
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        first = eng.generate([p], params)[0]
        computed = _rows(eng, p[: _blocks_of(p)])
        eng.generate([q], params)  # evicts p
        assert eng.cache.tier.flush(30) and eng.cache.tree.match(p)[0] == 0
        from_disk = eng.generate([p], params)[0]
        assert from_disk.cached_tokens == _blocks_of(p)
        assert torch.equal(_rows(eng, p[: _blocks_of(p)]), computed)
        assert from_disk.token_ids == first.token_ids
        eng.assert_consistent()
    finally:
        eng.close()
