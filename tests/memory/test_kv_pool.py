"""SlotAllocator and slots_from_budget: the KV memory accounting, no model needed."""

from __future__ import annotations

import pytest
import torch

from tripod.memory import kv_pool
from tripod.memory.kv_pool import KVPool, LatentPool, PoolSpec, SlotAllocator, slots_from_budget


def test_alloc_hands_out_distinct_slots_until_empty() -> None:
    a = SlotAllocator(8)
    assert a.num_free == 8
    first = a.alloc(3)
    second = a.alloc(5)
    assert first is not None and second is not None
    assert len(first) == 3 and len(second) == 5
    got = first + second
    assert sorted(got) == list(range(8)), "every slot handed out exactly once"
    assert a.num_free == 0
    assert a.free_set() == set()


def test_fresh_allocator_hands_out_ascending_runs() -> None:
    a = SlotAllocator(6)
    assert a.alloc(3) == [0, 1, 2]
    assert a.alloc(2) == [3, 4]


def test_alloc_zero_returns_empty_and_takes_nothing() -> None:
    a = SlotAllocator(4)
    assert a.alloc(0) == []
    assert a.num_free == 4


def test_alloc_failure_returns_none_and_takes_nothing() -> None:
    a = SlotAllocator(8)
    held = a.alloc(6)
    assert held is not None
    before = a.free_set()
    assert a.alloc(3) is None
    assert a.num_free == 2
    assert a.free_set() == before
    # The two left are still usable.
    rest = a.alloc(2)
    assert rest is not None and set(rest) == before


def test_free_returns_slots_for_reuse() -> None:
    a = SlotAllocator(4)
    s = a.alloc(4)
    assert s is not None
    a.free(s[:2])
    assert a.num_free == 2
    assert a.free_set() == set(s[:2])
    again = a.alloc(2)
    assert again is not None and set(again) == set(s[:2])
    assert a.num_free == 0


def test_double_free_asserts() -> None:
    a = SlotAllocator(4)
    s = a.alloc(2)
    assert s is not None
    a.free(s)
    with pytest.raises(AssertionError, match="double free"):
        a.free([s[0]])
    # A slot that was never handed out is free already: freeing it is also a double free.
    b = SlotAllocator(4)
    with pytest.raises(AssertionError, match="double free"):
        b.free([3])


def test_double_free_within_one_call_asserts() -> None:
    a = SlotAllocator(4)
    s = a.alloc(1)
    assert s is not None
    with pytest.raises(AssertionError, match="double free"):
        a.free([s[0], s[0]])


def test_allocator_needs_two_slots() -> None:
    with pytest.raises(ValueError, match="at least 2"):
        SlotAllocator(1)


# ---------------------------------------------------------------- slots_from_budget

_CPU = torch.device("cpu")


def test_budget_explicit_count_wins() -> None:
    n = slots_from_budget(
        kv_cache_tokens=1234,
        kv_mem_fraction=0.1,
        bytes_per_token=1 << 20,
        device=_CPU,
        max_tokens_cap=100,
    )
    # An explicit count is what the user asked for: neither memory nor the cap changes it.
    assert n == 1234


@pytest.mark.parametrize("bad", [1, 0, -5])
def test_budget_explicit_count_too_small_raises(bad: int) -> None:
    with pytest.raises(ValueError, match="kv_cache_tokens"):
        slots_from_budget(
            kv_cache_tokens=bad,
            kv_mem_fraction=0.1,
            bytes_per_token=64,
            device=_CPU,
            max_tokens_cap=1 << 20,
        )


@pytest.mark.parametrize("bad", [0.0, -0.1, 0.96, 1.0, 2.0])
def test_budget_bad_fraction_raises(bad: float) -> None:
    with pytest.raises(ValueError, match="kv_mem_fraction"):
        slots_from_budget(
            kv_cache_tokens=None,
            kv_mem_fraction=bad,
            bytes_per_token=64,
            device=_CPU,
            max_tokens_cap=1 << 20,
        )


def test_budget_fraction_of_host_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_pool, "_available_host_memory", lambda: 1 << 30)
    kw = dict(kv_cache_tokens=None, device=_CPU)
    # 1 GiB * 0.5 / 1 KiB per token = 524288 tokens.
    assert (
        slots_from_budget(kv_mem_fraction=0.5, bytes_per_token=1024, max_tokens_cap=1 << 30, **kw)
        == 524288
    )
    # The cap bounds the fraction-derived count.
    assert (
        slots_from_budget(kv_mem_fraction=0.5, bytes_per_token=1024, max_tokens_cap=1000, **kw)
        == 1000
    )
    # Never fewer than 2 slots, however little memory there is.
    assert (
        slots_from_budget(kv_mem_fraction=0.01, bytes_per_token=1 << 40, max_tokens_cap=1000, **kw)
        == 2
    )


def test_budget_fraction_uses_real_host_memory() -> None:
    n = slots_from_budget(
        kv_cache_tokens=None,
        kv_mem_fraction=0.01,
        bytes_per_token=1 << 20,
        device=_CPU,
        max_tokens_cap=1 << 30,
    )
    expected = int(kv_pool._available_host_memory() * 0.01) // (1 << 20)
    # Memory moves a little between the two reads; the formula must hold to within a few slots.
    assert n >= 2 and abs(n - max(2, expected)) <= 64


# ---------------------------------------------------------------- KVPool


def test_kv_pool_write_then_gather_round_trips() -> None:
    pool = KVPool(8, num_layers=2, num_kv_heads=3, head_dim=4, dtype=torch.float32, device=_CPU)
    assert pool.allocator.num_slots == 8
    g = torch.Generator().manual_seed(0)
    k = torch.randn(3, 3, 4, generator=g)
    v = torch.randn(3, 3, 4, generator=g)
    slots = torch.tensor([5, 1, 6])
    pool.write(1, slots, k, v)
    gk, gv = pool.gather(1, slots)
    assert torch.equal(gk, k) and torch.equal(gv, v)
    # Any slot shape: a [batch, len] table of slots gathers to [batch, len, heads, dim].
    table = torch.tensor([[6, 5], [1, 1]])
    tk, tv = pool.gather(1, table)
    assert tk.shape == (2, 2, 3, 4)
    assert torch.equal(tk[0, 0], k[2]) and torch.equal(tv[1, 1], v[1])
    # Other layers and untouched slots stay zero (padded reads never see garbage).
    ok, ov = pool.gather(0, slots)
    assert not ok.any() and not ov.any()
    zk, _ = pool.gather(1, torch.tensor([0, 7]))
    assert not zk.any()


def test_bytes_per_token_counts_k_and_v_in_every_layer() -> None:
    assert PoolSpec(30, "mha", num_kv_heads=3, head_dim=64).bytes_per_token(torch.bfloat16) == 2 * 30 * 3 * 64 * 2
    assert PoolSpec(2, "mha", num_kv_heads=1, head_dim=8).bytes_per_token(torch.float32) == 2 * 2 * 1 * 8 * 4
    # MLA: one latent per token and layer, no K/V split.
    assert PoolSpec(30, "latent", latent_dim=576).bytes_per_token(torch.bfloat16) == 30 * 576 * 2


def test_pool_spec_makes_the_pool_it_counts() -> None:
    mha = PoolSpec(2, "mha", num_kv_heads=1, head_dim=8).make(16, torch.float32, _CPU)
    assert isinstance(mha, KVPool) and mha.kv.shape == (2, 16, 2, 1, 8)
    lat = PoolSpec(3, "latent", latent_dim=24).make(16, torch.float32, _CPU)
    assert isinstance(lat, LatentPool) and lat.kv.shape == (3, 16, 24)
    slots = torch.tensor([3, 7])
    lat.write(1, slots, torch.arange(48, dtype=torch.float32).view(2, 24))
    assert torch.equal(lat.gather(1, slots), torch.arange(48, dtype=torch.float32).view(2, 24))
    assert lat.allocator.num_free == 16


def test_ranked_allocator_hands_out_each_ranks_own_range() -> None:
    """Data-parallel attention: rank d's slots are ``[d * per, (d + 1) * per)``; a rank's
    exhaustion leaves the other's free; freed slots go back to their own rank."""
    a = SlotAllocator(8, ranks=2)
    assert a.per_rank == 4 and a.free_on(0) == a.free_on(1) == 4
    first = a.alloc(3, 1)
    assert first == [4, 5, 6] and a.free_on(1) == 1 and a.free_on(0) == 4
    assert a.alloc(2, 1) is None and a.free_on(1) == 1  # not taken from rank 0's range
    zero = a.alloc(4, 0)
    assert zero == [0, 1, 2, 3] and a.num_free == 1
    a.free([5, 1])
    assert a.free_on(0) == 1 and a.free_on(1) == 2 and [a.rank_of(s) for s in (3, 4)] == [0, 1]
    with pytest.raises(ValueError, match="do not split evenly"):
        SlotAllocator(9, ranks=2)


def test_latent_pool_of_a_later_rank_holds_its_range_only() -> None:
    """Rank 1's pool holds global slots [per, 2 per) in its rows 0..per-1; padding (slot 0) reads row 0."""
    pool = PoolSpec(2, "latent", latent_dim=3).make(4, torch.float32, torch.device("cpu"), base=4)
    assert pool.kv.shape == (2, 4, 3)
    pool.write(1, torch.tensor([5, 7]), torch.tensor([[1.0, 2, 3], [4, 5, 6]]))
    assert torch.equal(pool.kv[1, 1], torch.tensor([1.0, 2, 3])) and torch.equal(pool.kv[1, 3], torch.tensor([4.0, 5, 6]))
    assert torch.equal(pool.gather(1, torch.tensor([[7, 0]]))[0, 0], torch.tensor([4.0, 5, 6]))
    with pytest.raises(IndexError):
        pool.gather(1, torch.tensor([8]))  # rank 2's slot: never this pool's
    with pytest.raises(ValueError, match="latent"):
        PoolSpec(2, "mha", num_kv_heads=1, head_dim=2).make(4, torch.float32, torch.device("cpu"), base=4)
