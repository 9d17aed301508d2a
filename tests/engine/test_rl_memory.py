"""The engine-side parts of the RL surface that need no server: a KV pool's memory given back and
taken again (every view of it stays usable, zeroed), and the models that refuse weight updates
say why (the end-to-end behaviour is tests/server/test_rl_serve.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tripod.engine.sleep import PoolRelease
from tripod.engine.weight_update import UpdateError, WeightUpdater
from tripod.memory.kv_pool import KVPool


def test_pool_release_and_restore_keep_every_view() -> None:
    pool = KVPool(64, 2, 2, 8, torch.float32, torch.device("cpu"))
    view = pool.kv[1]  # a holder's view of one layer, made before the sleep
    pool.kv.fill_(3.0)
    rel = PoolRelease(pool)
    assert rel.refusal() is None and rel.nbytes == 64 * 2 * 2 * 2 * 8 * 4
    assert rel.release() == 64 * 2 * 2 * 2 * 8 * 4
    assert rel.released and rel.nbytes == 0 and rel.release() == 0  # (idempotent)
    rel.restore()
    assert not rel.released and rel.nbytes == 64 * 2 * 2 * 2 * 8 * 4
    assert torch.equal(view, torch.zeros(64, 2, 2, 8))  # the old view sees the new memory, zeroed
    slots = torch.tensor([5, 9])
    pool.write(1, slots, torch.ones(2, 2, 8), torch.full((2, 2, 8), 2.0))
    k, v = pool.gather(1, slots)
    assert torch.equal(k, torch.ones(2, 2, 8)) and torch.equal(v, torch.full((2, 2, 8), 2.0))
    assert torch.equal(view[5, 0], torch.ones(2, 8))


@pytest.mark.parametrize(("weights", "why"), [("stored", "--weights stored"), ("fp8", "--weights fp8")])
def test_updates_refused_with_the_reason(weights: str, why: str) -> None:
    engine = SimpleNamespace(loaded=SimpleNamespace(weights=weights, path="m.gguf"), group=None, cache=None)
    up = WeightUpdater(engine)  # type: ignore[arg-type]
    assert why in (up.refusal() or "")
    with pytest.raises(UpdateError, match="dequantized weights") as e:
        up.stage(safetensors=b"x")
    assert e.value.kind == "unsupported"
