"""A weight update's fast path without a server (engine/weight_update.py, engine/weight_sync.py,
layers/weights.py): tensors received from a weight group lie per module in one buffer, in the
order the loader fuses them, so Q/K/V and gate/up become views of it (the same values as the
concatenation, no copy); a partial update reads from the checkpoint only the tensors it was not
sent; tied weights stay tied; greedy tokens equal the HF model of the weights after a full and a
partial update; a tensor with NaN or infinities is refused wherever it lies."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import pytest
import torch

from tests.conftest import HFReference, check_greedy_tokens
from tests.support.tiny_models import VOCAB, build_hf, save
from tripod import Engine, SamplingParams
from tripod.engine.weight_sync import ALIGN, buffers
from tripod.engine.weight_update import Layered, UpdateError, WeightUpdater, finite
from tripod.layers.weights import WeightSource

N = 12


class Counted(Mapping[str, torch.Tensor]):
    """A checkpoint's tensors, noting every name read."""

    def __init__(self, inner: Mapping[str, torch.Tensor]) -> None:
        self.inner, self.read = inner, set[str]()

    def __getitem__(self, name: str) -> torch.Tensor:
        self.read.add(name)
        return self.inner[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.inner)

    def __len__(self) -> int:
        return len(self.inner)


def _received(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` as a weight group's receiver holds it (module buffers), sent in reverse order."""
    names = list(reversed(state))
    out = dict(zip(names, buffers([(n, state[n].dtype, list(state[n].shape)) for n in names]), strict=True))
    for n, t in out.items():
        t.copy_(state[n])
    return out


def _params() -> SamplingParams:
    return SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)


def test_buffers_lay_fused_parts_back_to_back_aligned() -> None:
    p = "model.layers.0.self_attn."
    specs = [(p + "o_proj.weight", torch.float32, [8, 8]), (p + "v_proj.weight", torch.float32, [4, 8]),
             (p + "q_proj.weight", torch.float32, [8, 8]), (p + "k_proj.weight", torch.float32, [4, 8]),
             ("model.layers.0.input_layernorm.weight", torch.float32, [3])]
    o, v, q, k, norm = buffers(specs)
    assert [list(t.shape) for t in (o, v, q, k, norm)] == [s for _, _, s in specs]
    assert q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr() == o.untyped_storage().data_ptr()
    assert q.data_ptr() + q.nbytes == k.data_ptr() and k.data_ptr() + k.nbytes == v.data_ptr()
    assert norm.untyped_storage().data_ptr() != q.untyped_storage().data_ptr()  # another module's buffer
    assert all(t.data_ptr() % ALIGN == 0 for t in (o, v, q, k, norm))


def test_adjacent_parts_join_as_a_view_only_when_allowed() -> None:
    q, k, v = buffers([(f"a.{n}.weight", torch.float32, [r, 16]) for n, r in (("q_proj", 4), ("k_proj", 2), ("v_proj", 2))])
    for i, t in enumerate((q, k, v)):
        t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(i)))
    names = ["a.q_proj.weight", "a.k_proj.weight", "a.v_proj.weight"]
    sent = dict(zip(names, (q, k, v), strict=True))
    joined, _ = WeightSource(Layered(sent, {}), torch.float32, torch.device("cpu")).cat(names)
    assert torch.equal(joined, torch.cat([q, k, v])) and joined.data_ptr() == q.data_ptr()  # a view, no copy
    for base in (sent, Layered({}, sent)):  # a checkpoint's tensors, even back to back: never by reference
        copied, _ = WeightSource(base, torch.float32, torch.device("cpu")).cat(names)
        assert torch.equal(copied, joined) and copied.data_ptr() != q.data_ptr()
    swapped, _ = WeightSource(Layered(sent, {}), torch.float32, torch.device("cpu")).cat([names[1], names[0]])
    assert torch.equal(swapped, torch.cat([k, q]))  # not in buffer order: copied, still right
    as_bf16, _ = WeightSource(Layered(sent, {}), torch.bfloat16, torch.device("cpu")).cat(names)
    assert torch.equal(as_bf16, torch.cat([q, k, v]).bfloat16())  # converted parts are copies


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_finite_finds_any_nan_or_infinity(dtype: torch.dtype) -> None:
    t = torch.randn(1000).to(dtype)
    assert finite(t) and finite(t[:0])
    for bad in (float("nan"), float("inf"), float("-inf")):
        for at in (0, 517, 999):
            u = t.clone()
            u[at] = bad
            assert not finite(u), (bad, at)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, hf_tokenizer: Any) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("rl-update")
    a, b = build_hf("llama", seed=3), build_hf("llama", seed=4, tie_word_embeddings=True)
    return {"a": a, "b": b, "folder_b": save(b, tmp / "b", hf_tokenizer)}


def test_full_then_partial_update_equal_hf_reading_only_what_was_not_sent(models: dict[str, Any]) -> None:
    a, b = models["a"], models["b"]
    eng = Engine(model=str(models["folder_b"]), dtype="float32", kv_cache_tokens=2048)
    model = eng.loaded.model
    assert model.lm_head is None  # b ties its head to the embedding
    prompt = torch.randint(3, VOCAB, (9,), generator=torch.Generator().manual_seed(1)).tolist()
    up = WeightUpdater(eng)
    shapes = up._shapes()  # (read once per checkpoint, before counting)
    base = Counted(up._base(up.path))
    up._source = (up.path, base)
    params = dict(model.named_parameters())
    # Full: a's weights (its own head dropped: b's checkpoint ties it), every tensor sent.
    state = {k: v.contiguous() for k, v in a.state_dict().items() if k in shapes}
    assert set(state) == set(shapes)
    up.apply(up.stage(tensors=_received(state)))
    assert base.read == set()  # the update covered every tensor: the checkpoint was not read
    assert dict(model.named_parameters()) == params  # the same Parameter objects, new tensors
    assert model.layers[0].attn.qkv.data_ptr() == up.overlay["model.layers.0.self_attn.q_proj.weight"].data_ptr()
    tied = build_hf("llama", seed=3, tie_word_embeddings=True)
    tied.load_state_dict({k: v for k, v in a.state_dict().items() if k != "lm_head.weight"}, strict=False)
    (out,) = eng.generate([prompt], _params())
    check_greedy_tokens(out.token_ids, HFReference(tied).greedy(prompt, N), "after a full update")
    # Partial: b's layer-1 MLP over that; the checkpoint is read for nothing (the rest was sent).
    part = {k: v.contiguous() for k, v in b.state_dict().items() if k.startswith("model.layers.1.mlp.")}
    up.apply(up.stage(tensors=_received(part)))
    assert base.read == set()
    tied.load_state_dict(part, strict=False)
    (out,) = eng.generate([prompt], _params())
    check_greedy_tokens(out.token_ids, HFReference(tied).greedy(prompt, N), "after a partial update")
    # After a folder update (b again), a partial one reads exactly the tensors it was not sent.
    up.apply(up.stage(model_path=str(models["folder_b"])))
    up._shapes()
    base = Counted(up._base(up.path))
    up._source = (up.path, base)
    up.apply(up.stage(tensors=_received(part)))
    assert base.read == set(shapes) - set(part)
    (out,) = eng.generate([prompt], _params())
    check_greedy_tokens(out.token_ids, HFReference(b).greedy(prompt, N), "b, its own MLP sent")
    assert up.version == 4


def test_nonfinite_names_from_the_receiver_refuse_the_update(models: dict[str, Any]) -> None:
    eng = Engine(model=str(models["folder_b"]), dtype="float32", kv_cache_tokens=1024)
    up = WeightUpdater(eng)
    name = "model.layers.0.mlp.up_proj.weight"
    sent = {name: models["a"].state_dict()[name].clone()}
    with pytest.raises(UpdateError, match="NaN or infinite"):
        up.stage(tensors=sent, nonfinite=[name])
    sent[name][3, 5] = float("nan")
    with pytest.raises(UpdateError, match="NaN or infinite"):
        up.stage(tensors=sent)
    assert up.version == 0
