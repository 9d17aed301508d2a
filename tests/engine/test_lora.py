"""LoRA adapters (PEFT folders made here with ``peft``) served beside the base model.

A tiny random Llama and three random adapters (different targets, ranks, rsLoRA) saved by PEFT;
each adapter's greedy tokens are PEFT/transformers' (the adapter injected, unmerged, float32),
alone and in one batch mixing the three and the base, on the reference path and tripod's kernels.
The prefix cache never serves one adapter's (or the base's) prefix to another; more adapters
than ``max_loras`` rotate through the resident set; a malformed adapter is refused with the reason.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import HFReference, check_greedy_tokens
from tests.support.lora_adapters import ADAPTERS, make_adapter, other_llama
from tests.support.tiny_models import VOCAB, build_hf, save
from tripod import Engine, SamplingParams

N = 16
def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (21, 9, 33, 14)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory, hf_tokenizer: Any) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("lora")
    base = build_hf("llama", seed=3)
    folder = save(base, tmp / "base", hf_tokenizer)
    refs: dict[str | None, HFReference] = {None: HFReference(base)}
    paths: dict[str, Path] = {}
    for i, kind in enumerate(ADAPTERS):
        paths[kind] = tmp / kind
        refs[kind] = HFReference(make_adapter(base, kind, paths[kind], seed=10 + i))
    return {"folder": folder, "paths": paths, "refs": refs, "tmp": tmp}


def _engine(setup: dict[str, Any], **kw: Any) -> Engine:
    spec = ",".join(f"{k}={p}" for k, p in setup["paths"].items())
    return Engine(model=str(setup["folder"]), dtype="float32", kv_cache_tokens=4096, chunk_size=16, lora=spec, **kw)


def _params(lora: str | None) -> SamplingParams:
    return SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True, lora=lora)


@pytest.mark.parametrize("kernels", ["eager", "optimized"])
def test_each_adapter_matches_peft_alone_and_mixed(setup: dict[str, Any], kernels: str) -> None:
    eng = _engine(setup, kernels=kernels)
    prompts, refs = _prompts(), setup["refs"]
    names: list[str | None] = [*ADAPTERS, None]
    for name in names:
        (out,) = eng.generate([prompts[0]], _params(name))
        check_greedy_tokens(out.token_ids, refs[name].greedy(prompts[0], N), f"{name} alone")
    # One batch mixing the three adapters and the base, every prompt under every one of them.
    mixed = [(p, name) for p in prompts for name in names]
    outs = eng.generate([p for p, _ in mixed], [_params(name) for _, name in mixed])
    for (p, name), out in zip(mixed, outs, strict=True):
        check_greedy_tokens(out.token_ids, refs[name].greedy(p, N), f"{name} mixed")
    assert refs["attn"].greedy(prompts[0], N).tokens != refs[None].greedy(prompts[0], N).tokens  # adapters matter
    eng.assert_consistent()


def test_prefix_cache_never_crosses_adapters(setup: dict[str, Any]) -> None:
    """The same prompt under the base, then adapter ``attn``, then ``mlp``: each first run computes
    its whole prompt (a cache keyed by tokens alone would hand the base's KV to the adapters and
    their tokens would differ), the second run of each hits its own prefix."""
    eng = _engine(setup, kernels="eager")
    p, refs = _prompts()[2], setup["refs"]
    for name in (None, "attn", "mlp"):
        before = eng.stats.cached_prompt_tokens
        (first,) = eng.generate([p], _params(name))
        assert eng.stats.cached_prompt_tokens == before, f"{name}: reused another's cached prefix"
        check_greedy_tokens(first.token_ids, refs[name].greedy(p, N), f"{name} first")
        (again,) = eng.generate([p], _params(name))
        assert eng.stats.cached_prompt_tokens > before, f"{name}: its own prefix was not reused"
        assert again.token_ids == first.token_ids


def test_more_adapters_than_resident(setup: dict[str, Any]) -> None:
    """``max_loras=1``: the three adapters take turns in the one resident place (each read back
    when needed); a batch of the three still runs, each request on its own adapter's weights."""
    eng = _engine(setup, kernels="eager", max_loras=1)
    p, refs = _prompts()[1], setup["refs"]
    outs = eng.generate([p, p, p], [_params(k) for k in ADAPTERS])
    for name, out in zip(ADAPTERS, outs, strict=True):
        check_greedy_tokens(out.token_ids, refs[name].greedy(p, N), f"{name} rotating")
    assert eng.loras is not None and eng.loras.loads > len(ADAPTERS)  # read again after an eviction
    assert len(eng.loras.resident) <= 1


def test_load_unload_and_refusals(setup: dict[str, Any], tmp_path: Path) -> None:
    eng = Engine(model=str(setup["folder"]), dtype="float32", kv_cache_tokens=2048, kernels="eager")
    p = _prompts()[0]
    with pytest.raises(ValueError, match="no LoRA adapter named 'attn'"):
        eng.generate([p], _params("attn"))
    eng.load_lora("attn", str(setup["paths"]["attn"]))
    (out,) = eng.generate([p], _params("attn"))
    check_greedy_tokens(out.token_ids, setup["refs"]["attn"].greedy(p, N), "attn loaded live")
    with pytest.raises(ValueError, match="already loaded"):
        eng.load_lora("attn", str(setup["paths"]["attn"]))
    assert eng.unload_lora("attn") == 0
    with pytest.raises(ValueError, match="no LoRA adapter named 'attn'"):
        eng.generate([p], _params("attn"))
    # Malformed adapters: each refused, saying what is wrong.
    wrong = tmp_path / "wrong-shape"
    make_adapter(other_llama(), "attn", wrong, seed=4)  # made for a model 48 wide (the base: 64)
    with pytest.raises(ValueError, match="do not fit the base model"):
        eng.load_lora("wrong", str(wrong))
    head = tmp_path / "lm-head"
    shutil.copytree(setup["paths"]["mlp"], head)
    conf = json.loads((head / "adapter_config.json").read_text())
    conf["modules_to_save"] = ["lm_head"]
    (head / "adapter_config.json").write_text(json.dumps(conf))
    with pytest.raises(ValueError, match="modules_to_save"):
        eng.load_lora("head", str(head))
    with pytest.raises(ValueError, match=r"needs adapter_config\.json"):
        eng.load_lora("empty", str(tmp_path))
    torn = tmp_path / "torn"
    shutil.copytree(setup["paths"]["mlp"], torn)
    (torn / "adapter_model.safetensors").write_bytes(b"\0" * 20)
    with pytest.raises(ValueError, match="not a readable safetensors"):
        eng.load_lora("torn", str(torn))
    with pytest.raises(ValueError, match="rank 16 is over --max-lora-rank 8"):
        Engine(model=str(setup["folder"]), dtype="float32", kv_cache_tokens=512, max_lora_rank=8,
               lora=f"rs={setup['paths']['all-rs']}")


def test_prompt_logprobs_run_the_adapter(setup: dict[str, Any]) -> None:
    """Prompt scoring (its own pass outside the steps) runs the request's adapter: each prompt
    token's logprob is the adapted model's (PEFT's), not the base's."""
    eng = _engine(setup, kernels="eager")
    p = _prompts()[0]
    (out,) = eng.generate([p], SamplingParams(max_tokens=1, prompt_logprobs=0, lora="attn"))
    assert out.prompt_logprobs is not None
    got = torch.tensor([lp.logprob for lp in out.prompt_logprobs[1:] if lp is not None])
    for name, close in (("attn", True), (None, False)):
        with torch.no_grad():
            logits = setup["refs"][name].model(input_ids=torch.tensor([p])).logits[0].float()
        want = torch.log_softmax(logits, -1)[torch.arange(len(p) - 1), torch.tensor(p[1:])]
        assert torch.allclose(got, want, atol=1e-4) == close, name


def test_continuation_on_an_adapter_equals_the_undisturbed_answer(setup: dict[str, Any]) -> None:
    """A failover continuation (``Resume``: the tokens so far, recomputed like a prompt) of an
    adapter's seeded answer continues it token for token on the same adapter."""
    from tests.engine.test_continuation import continued
    from tripod.engine.request import Resume

    eng = _engine(setup, kernels="eager")
    p = _prompts()[3]
    params = SamplingParams(max_tokens=N, temperature=0.8, seed=9, ignore_eos=True, lora="mlp")
    (whole,) = eng.generate([p], params)
    got = continued(eng, p, params, [Resume(0, tuple(whole.token_ids[:5]))])[0]
    assert got.output_ids == whole.token_ids


def test_unload_while_running_keeps_the_weights_until_the_request_ends(setup: dict[str, Any]) -> None:
    """An adapter unloaded while a request runs on it: the request finishes on its weights (PEFT's
    tokens), the name cannot be loaded again until then, and afterwards its place is free again."""
    eng = _engine(setup, kernels="eager", max_loras=3)
    assert eng.loras is not None
    p = _prompts()[2]
    (req,) = eng.add_request(p, _params("mlp"))
    while not req.output_ids:  # running, holding the adapter
        eng.step()
    assert eng.unload_lora("mlp") == 1
    with pytest.raises(ValueError, match="still has 1 running"):
        eng.load_lora("mlp", str(setup["paths"]["mlp"]))
    while eng.has_work:
        eng.step()
    check_greedy_tokens(req.output_ids, setup["refs"]["mlp"].greedy(p, N), "mlp unloaded mid-run")
    assert "mlp" not in eng.loras.resident and eng.loras.free_places == 1
    eng.load_lora("mlp", str(setup["paths"]["mlp"]))  # loads again, in the freed place
    assert eng.loras.resident["mlp"].slot is not None


def test_an_adapter_replaced_while_its_request_waits_is_refused_not_swapped(setup: dict[str, Any]) -> None:
    """A request names its adapter once (admission resolves it into a handle). If the adapter is
    unloaded and other files loaded under the same name before the request runs, it is refused with
    the reason, never run on the other weights (nor cached under the old adapter's namespace); the
    engine goes on serving."""
    eng = _engine(setup, kernels="eager", max_running=1)
    first, waiting = _prompts()[0], _prompts()[1]
    (busy,) = eng.add_request(first, _params(None))
    while not busy.output_ids:  # the only running slot is taken
        eng.step()
    (req,) = eng.add_request(waiting, _params("attn"))
    assert req.lora is not None and not req.slots
    assert eng.unload_lora("attn") == 0
    eng.load_lora("attn", str(setup["paths"]["mlp"]))  # the same name, other weights
    while eng.has_work or eng.pending:
        eng.step()
    assert req.finish_reason is not None and req.finish_reason.value == "error" and not req.output_ids
    assert req.error is not None and "unloaded or replaced" in req.error
    check_greedy_tokens(busy.output_ids, setup["refs"][None].greedy(first, N), "the running request")
    (again,) = eng.generate([waiting], _params("attn"))  # sent again: the adapter loaded now
    check_greedy_tokens(again.token_ids, setup["refs"]["mlp"].greedy(waiting, N), "attn, now mlp's files")
    eng.assert_consistent()
