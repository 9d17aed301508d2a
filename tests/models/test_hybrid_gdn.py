"""Qwen3.5 (Gated DeltaNet + gated attention) through the engine, token-exact against transformers.

A tiny random Qwen3.5 checkpoint is built and saved with transformers; tripod loads the folder and
its greedy tokens are compared with transformers' on the same weights: each prompt alone, all in one
batch, and with prefill chunks shorter than the prompts. On tripod's CPU kernels (the path whose
rows never depend on their batch) the logprobs of every token are also equal bit for bit alone,
batched and chunked: the recurrent state of a sequence does not depend on how its tokens were split
into steps. Then the state pool's accounting (slots taken
at admission, freed at the end and on retraction; admissions wait for a slot), prefix-cache hits
that resume from state snapshots on radix nodes, and the features refused at start.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import HFReference, check_greedy_tokens
from tripod import Engine, SamplingParams
from tripod.memory.state_pool import StatePool, StateSpec, check_fits
from tripod.protocol.stats import StateStats

VOCAB = 256
N_TOKENS = 16
CONFIG: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
    linear_num_value_heads=4, linear_conv_kernel_dim=4, max_position_embeddings=512, bos_token_id=1,
    eos_token_id=2, pad_token_id=0,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
)


MOE: dict[str, Any] = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                          shared_expert_intermediate_size=48)
# model_type -> its config beyond CONFIG: Qwen3.5-MoE (every layer MoE), Qwen3-Next (one dense layer)
FAMILIES: dict[str, dict[str, Any]] = {
    "qwen3_5_text": {},
    "qwen3_5_moe_text": dict(MOE, intermediate_size=None),
    "qwen3_next": dict(MOE, mlp_only_layers=[1], norm_topk_prob=True),
}


def build_qwen3_5(seed: int = 0, model_type: str = "qwen3_5_text", **overrides: Any) -> Any:
    """transformers' Qwen3.5 (or a sibling family; fp32, eval) with decisive random weights:
    unit-variance projections, (1 + w) norms off zero, the mixer's own norm around one, decays and
    conv taps of real size."""
    from transformers import AutoConfig, AutoModelForCausalLM

    extra = FAMILIES[model_type]
    cfg = AutoConfig.for_model(model_type, **{k: v for k, v in {**CONFIG, **extra, **overrides}.items() if v is not None})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "conv1d" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif p.ndim >= 2:
                std = 1.0 if "embed" in name else (3.0 if "lm_head" in name else 1.0) / math.sqrt(p.shape[-1])
                p.copy_(torch.randn(p.shape, generator=g) * std)
            elif name.endswith("norm.weight"):
                base = 1.0 if "linear_attn" in name else 0.0  # the mixer's gated norm scales by w, the others by 1 + w
                p.copy_(base + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("A_log") or name.endswith("dt_bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
    model.eval()
    return model


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (37, 5, 22)]


PROMPTS = _prompts()
PARAMS = SamplingParams(max_tokens=N_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, HFReference]:
    model = build_qwen3_5()
    folder = tmp_path_factory.mktemp("qwen3_5")
    model.save_pretrained(str(folder))
    return folder, HFReference(model)


def _engine(folder: Path, **kw: Any) -> Engine:
    args: dict[str, Any] = dict(dtype="float32", kv_cache_tokens=1024, chunk_size=64, max_batch_tokens=128,
                                max_running=4, kernels="eager")
    return Engine(model=str(folder), **{**args, **kw})


def _logprobs(out: Any) -> list[float]:
    return [lp.logprob for lp in out.logprobs]


@pytest.mark.parametrize("kernels", ["eager", "optimized"])
def test_qwen3_5_greedy_parity_alone_batched_chunked(kernels: str, qwen3_5: tuple[Path, HFReference]) -> None:
    folder, ref = qwen3_5
    refs = [ref.greedy(p, N_TOKENS) for p in PROMPTS]
    eng = _engine(folder, kernels=kernels)
    assert eng.model_config.architecture == "Qwen3_5ForCausalLM"
    assert eng.states is not None and eng.states.num_slots == 4
    alone = []
    for i, p in enumerate(PROMPTS):
        (out,) = eng.generate([p], PARAMS)
        check_greedy_tokens(out.token_ids, refs[i], f"{kernels} prompt {i} alone")
        alone.append(out)
    batched = eng.generate(PROMPTS, PARAMS)
    chunked = _engine(folder, kernels=kernels, chunk_size=6, max_batch_tokens=16).generate(PROMPTS, PARAMS)
    # (the reference path's F.linear / SDPA results depend on how many rows share a call)
    bitwise = kernels == "optimized" and eng.runner.uses_kernels
    for i in range(len(PROMPTS)):
        for what, out in (("batched", batched[i]), ("chunked", chunked[i])):
            check_greedy_tokens(out.token_ids, refs[i], f"{kernels} prompt {i} {what}")
            if bitwise:
                assert out.token_ids == alone[i].token_ids
                assert _logprobs(out) == _logprobs(alone[i]), f"prompt {i}: {what} logprobs differ from alone"
    eng.assert_consistent()


@pytest.mark.slow  # about 20-40 s each on 2 cores (transformers' reference dominates)
@pytest.mark.parametrize("model_type", ["qwen3_5_moe_text", "qwen3_next"])
def test_moe_and_next_families(model_type: str, tmp_path: Path) -> None:
    """Qwen3.5-MoE (a MoE with a gated shared expert on every layer) and Qwen3-Next (its mixer's
    projections grouped per key head, reordered at load; 2 value heads per key head here): greedy
    tokens equal transformers', batched and chunked, on tripod's CPU kernels. (Not bitwise: the
    experts run each expert's rows of the step in one matmul, as for every MoE family.)"""
    model = build_qwen3_5(model_type=model_type)
    model.save_pretrained(str(tmp_path))
    ref = HFReference(model)
    prompts = PROMPTS[1:]
    eng = _engine(tmp_path, kernels="optimized")
    assert eng.model_config.moe is not None and eng.model_config.hybrid is not None
    batched = eng.generate(prompts, PARAMS)
    chunked = _engine(tmp_path, kernels="optimized", chunk_size=5, max_batch_tokens=16).generate(prompts, PARAMS)
    for i, p in enumerate(prompts):
        check_greedy_tokens(batched[i].token_ids, ref.greedy(p, N_TOKENS), f"{model_type} prompt {i} batched")
        check_greedy_tokens(chunked[i].token_ids, ref.greedy(p, N_TOKENS), f"{model_type} prompt {i} chunked")
    eng.assert_consistent()


def test_hybrid_prefix_hits_resume_from_state_snapshots(qwen3_5: tuple[Path, HFReference]) -> None:
    """A hit resumes at the deepest cached node holding a state snapshot: the end of a prefill chunk,
    or where a finished request stopped (prompt + output: an agent's next turn). It skips exactly
    ``cached_tokens`` and changes nothing: tokens and logprobs as an engine that never saw it."""
    folder, _ = qwen3_5
    eng = _engine(folder, kernels="optimized", chunk_size=8, max_batch_tokens=32)
    fresh = _engine(folder, kernels="optimized", chunk_size=8, max_batch_tokens=32, enable_prefix_cache=False)
    assert eng.scheduler.snapshots is not None and fresh.scheduler.snapshots is None
    p = PROMPTS[0]  # 37 tokens: chunks end at 8, 16, 24, 32
    (first,) = eng.generate([p], PARAMS)
    assert first.cached_tokens == 0
    (again,) = eng.generate([p], PARAMS)
    assert again.cached_tokens == 32  # the last chunk end before the prompt's last token
    longer = p + first.token_ids + PROMPTS[1]  # the next turn extends prompt + answer
    (ext,) = eng.generate([longer], PARAMS)
    assert ext.cached_tokens == len(p) + N_TOKENS - 1  # all but the answer's last token (never computed)
    bitwise = eng.runner.uses_kernels
    for got, prompt in ((again, p), (ext, longer)):
        (want,) = fresh.generate([prompt], PARAMS)
        assert got.token_ids == want.token_ids
        if bitwise:
            assert _logprobs(got) == _logprobs(want)
    stats = eng.snapshot()
    assert stats.prefix_hit_tokens == 32 + len(p) + N_TOKENS - 1
    st = stats.states  # (what /debug/engine reports)
    assert isinstance(st, StateStats) and st.snapshots_restored == 2 and st.free == st.slots == 4
    assert st.snapshot_bytes == st.snapshots_held * st.bytes_per_slot > 0
    eng.assert_consistent()


def test_snapshot_store_evicts_least_recently_used(qwen3_5: tuple[Path, HFReference]) -> None:
    """One snapshot slot: each new snapshot replaces the last; a hit still only resumes where a
    snapshot is, and its tokens stay those of a cold run."""
    folder, _ = qwen3_5
    eng = _engine(folder, max_state_snapshots=1, chunk_size=8, max_batch_tokens=32)
    snaps = eng.scheduler.snapshots
    assert snaps is not None and snaps.store.num_slots == 1
    a, b = PROMPTS[0], PROMPTS[2]
    (out_a,) = eng.generate([a], PARAMS)
    eng.generate([b], PARAMS)  # its snapshots replace a's
    assert snaps.used == 1 and snaps.taken > 2
    (again,) = eng.generate([a + out_a.token_ids], PARAMS)
    assert again.cached_tokens == 0  # a's snapshot is gone: nothing to resume from
    (cold,) = _engine(folder, chunk_size=8, max_batch_tokens=32).generate([a + out_a.token_ids], PARAMS)
    assert again.token_ids == cold.token_ids
    eng.assert_consistent()


def test_state_slots_bound_admission_and_are_freed(qwen3_5: tuple[Path, HFReference]) -> None:
    """Fewer state slots than --max-running: admissions wait for one, never more requests run than
    slots; every slot is back in the free list at the end."""
    folder, ref = qwen3_5
    eng = _engine(folder, max_state_slots=2)
    states = eng.states
    assert states is not None and states.num_slots == 2
    for p in PROMPTS:
        eng.add_request(p, PARAMS)
    done: dict[str, list[int]] = {}
    most = 0
    while eng.has_work:
        for o in eng.step():
            if o.finished:
                done[o.req.rid] = list(o.req.output_ids)
        running = eng.scheduler.running
        most = max(most, len(running))
        assert len(running) + states.num_free == states.num_slots
        assert len({r.state_slot for r in running}) == len(running)
    assert most == 2, f"at most 2 requests may run with 2 state slots (saw {most})"
    assert states.num_free == states.num_slots
    outs = [done[k] for k in sorted(done, key=lambda rid: int(rid.rsplit("-", 1)[-1]))]
    for i, toks in enumerate(outs):
        check_greedy_tokens(toks, ref.greedy(PROMPTS[i], N_TOKENS), f"prompt {i} behind the state slots")
    eng.assert_consistent()


def test_retraction_frees_the_state_and_recomputes_exactly(qwen3_5: tuple[Path, HFReference]) -> None:
    """A KV pool too small for every running request: the scheduler retracts one, its state slot is
    freed, and when it runs again it starts from the empty state: the same tokens."""
    folder, ref = qwen3_5
    eng = _engine(folder, kv_cache_tokens=100, max_batch_tokens=64)
    outs = eng.generate(PROMPTS, PARAMS)
    assert eng.scheduler.num_retractions > 0, "the pool was meant to force a retraction"
    for i, out in enumerate(outs):
        check_greedy_tokens(out.token_ids, ref.greedy(PROMPTS[i], N_TOKENS), f"prompt {i} with retractions")
    assert eng.states is not None and eng.states.num_free == eng.states.num_slots
    eng.assert_consistent()


@pytest.mark.parametrize(("overrides", "feature"), [
    ({"speculative": "mtp"}, "--speculative mtp"),
    ({"speculative": "self:1"}, "--speculative self:K"),
    ({"lora": "a=/nonexistent"}, "--lora"),
    ({"overlap_schedule": "on"}, "--overlap-schedule on"),
])
def test_hybrid_refuses_what_it_cannot_run_exactly(overrides: dict[str, Any], feature: str,
                                                   qwen3_5: tuple[Path, HFReference]) -> None:
    folder, _ = qwen3_5
    with pytest.raises(ValueError, match="hybrid") as err:
        _engine(folder, **overrides)
    assert feature in str(err.value)


def test_hybrid_export_and_jump_forward(qwen3_5: tuple[Path, HFReference]) -> None:
    folder, _ = qwen3_5
    eng = _engine(folder)
    assert eng.export_kv(PROMPTS[0]) == []  # no snapshot of it: nothing that could resume it (tests/models/test_hybrid_disk.py)
    assert eng.config.jump_forward  # (a rejected draft's state is rolled back: tests/models/test_hybrid_speculative.py)


def test_kv_pool_holds_only_the_attention_layers(qwen3_5: tuple[Path, HFReference]) -> None:
    folder, _ = qwen3_5
    eng = _engine(folder)
    assert eng.pool.kv.shape[0] == 2  # layers 1 and 3 attend; 0 and 2 keep recurrent state only
    assert eng.states is not None
    # per linear layer: conv window [2*2*8 + 4*8, 3] and recurrent state [4, 8, 8], float32
    assert eng.states.spec.layers == (((64, 3), (4, 8, 8)),) * 2
    assert eng.states.bytes_per_slot == 2 * 4 * (64 * 3 + 4 * 8 * 8)


def test_conditional_generation_folder_runs_its_text_part(qwen3_5: tuple[Path, HFReference], tmp_path: Path) -> None:
    """A Qwen3.5 multimodal folder (``model.language_model.*``, ``text_config``): its decoder runs."""
    from safetensors.torch import load_file, save_file

    folder, ref = qwen3_5
    text = json.loads((folder / "config.json").read_text())
    outer = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "text_config": text,
             "tie_word_embeddings": text.get("tie_word_embeddings", False)}
    (tmp_path / "config.json").write_text(json.dumps(outer))
    weights = load_file(str(folder / "model.safetensors"))
    renamed = {("model.language_model." + k[len("model."):]) if k.startswith("model.") else k: v
               for k, v in weights.items()}
    save_file(renamed, str(tmp_path / "model.safetensors"))
    eng = _engine(tmp_path)
    assert eng.model_config.architecture == "Qwen3_5ForConditionalGeneration"
    (out,) = eng.generate([PROMPTS[2]], PARAMS)
    check_greedy_tokens(out.token_ids, ref.greedy(PROMPTS[2], N_TOKENS), "text part of the multimodal folder")


def test_state_pool_unit() -> None:
    spec = StateSpec((((4, 3), (2, 2, 2)),))
    pool = StatePool(spec, 2, torch.device("cpu"))
    a = pool.alloc()
    assert a is not None
    pool.tensors[0][1][a].fill_(5.0)
    b = pool.alloc()
    assert b is not None and b != a and pool.alloc() is None
    pool.free(a)
    with pytest.raises(AssertionError):
        pool.free(a)
    again = pool.alloc()
    assert again == a and float(pool.tensors[0][1][a].abs().sum()) == 0.0  # handed out zeroed
    with pytest.raises(ValueError, match="--max-running"):
        check_fits(spec, 1000, 1000, "free memory")
