"""Speculative decoding on hybrid models (Gated DeltaNet and Mamba2): lossless, with exact rollback.

A verify item runs ``[last token, d1 .. dk]`` through the linear layers, which advance the
recurrent state over every draft; the mixers keep the state after each row and the engine puts back
the state after the last accepted one (``memory/state_pool.StateTrace``). So greedy decoding with
n-gram or draft-model speculation gives the tokens of plain decoding and, on tripod's CPU kernels
(rows never depend on their batch), the same logprobs bit for bit; and after each step a
request's state equals the state plain decoding has after the same tokens.

The tiny checkpoints are random, with the mixers' and MLPs' output projections scaled down so that
the model's next token leans on the current one: its greedy text falls into cycles that n-gram and
a draft sharing its embeddings guess in part — drafts are both accepted and rejected.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.models.test_hybrid_gdn import CONFIG
from tripod import Engine, SamplingParams
from tripod.engine.request import GrammarSpec, Req

transformers = pytest.importorskip("transformers")

V = 32  # a small vocabulary: a draft model sharing the target's embeddings guesses right often enough
NEW = 32
PARAMS = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, logprobs=0)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    motifs = [torch.randint(3, V, (6,), generator=g).tolist() for _ in range(2)]
    # repeated motifs (n-gram drafts from the prompt) and free text; lengths that chunk unevenly
    return [motifs[0] * 4, torch.randint(3, V, (5,), generator=g).tolist(), motifs[1] * 7,
            torch.randint(3, V, (11,), generator=g).tolist()]


PROMPTS = _prompts()


CHARS = ["<pad>", "<s>", "</s>", *"abcdefghijklmnopqrstuvw", *'{}":, ']  # one token per character


def _tokenizer(folder: Path) -> None:
    """A tokenizer of V one-character tokens (a draft must tokenize exactly like its target, and
    grammar-forced text has exactly one tokenization)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    assert len(CHARS) == V
    tk = Tokenizer(models.WordLevel({c: i for i, c in enumerate(CHARS)}, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<pad>", pad_token="<pad>",
                                                bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(str(folder))


def _randomize(model: Any, seed: int, scale: float = 0.3) -> None:
    """Every weight random; the layers' output projections scaled by ``scale`` (see the module docstring)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "conv1d" in name:
                p.copy_(0.5 * noise)
            elif p.ndim >= 2:
                p.copy_(noise * (1.0 if "embed" in name else 1.0 / math.sqrt(p.shape[-1])))
            elif "norm" in name:
                p.copy_((1.0 if "linear_attn" in name or "mixer" in name else 0.0) + 0.1 * noise)
            else:  # A_log, dt_bias, D, biases
                p.copy_(0.5 * noise)
            if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
                p.mul_(scale)


def _gdn(folder: Path) -> Any:
    cfg = transformers.AutoConfig.for_model("qwen3_5_text", **{**CONFIG, "vocab_size": V})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    _randomize(model, 1)
    model.save_pretrained(str(folder))
    return model


def _mamba(folder: Path) -> Any:
    cfg = transformers.NemotronHConfig(
        vocab_size=V, hidden_size=64, layers_block_type=["linear_attention", "full_attention", "mlp", "linear_attention"],
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, mamba_num_heads=4, mamba_head_dim=16,
        ssm_state_size=8, n_groups=2, conv_kernel=4, chunk_size=8, intermediate_size=48, max_position_embeddings=256)
    torch.manual_seed(0)
    model = transformers.NemotronHForCausalLM(cfg).eval()
    _randomize(model, 1, 0.7)  # (at 0.3 its greedy text is one cycle from the start: no rejections)
    model.save_pretrained(str(folder))
    return model


BUILD = {"gated_delta": _gdn, "mamba2": _mamba}


@pytest.fixture(scope="module", params=list(BUILD))
def hybrid(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the hybrid's folder, a one-layer Llama draft's folder sharing its embeddings and head)."""
    folder = tmp_path_factory.mktemp(request.param)
    target = BUILD[request.param](folder)
    _tokenizer(folder)
    hidden = target.config.hidden_size
    draft = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=V, hidden_size=hidden, intermediate_size=64, num_hidden_layers=1, num_attention_heads=hidden // 32,
        num_key_value_heads=1, head_dim=32, max_position_embeddings=512, tie_word_embeddings=False))
    with torch.no_grad():
        draft.get_input_embeddings().weight.copy_(target.get_input_embeddings().weight)
        draft.get_output_embeddings().weight.copy_(target.get_output_embeddings().weight)
        for name, p in draft.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.zero_()  # the draft: a bigram model of the target's embeddings and head
    dfolder = tmp_path_factory.mktemp(request.param + "_draft")
    draft.save_pretrained(str(dfolder))
    _tokenizer(dfolder)
    return folder, dfolder


def _engine(folder: Path, **kw: Any) -> Engine:
    # chunks of 8 and 24 tokens a step: long prompts' chunks run beside other requests' verify rows
    args: dict[str, Any] = dict(dtype="float32", kv_cache_tokens=1024, chunk_size=8, max_batch_tokens=24,
                                max_running=4, kernels="optimized", num_draft_tokens=3, spec_adaptive=False)
    return Engine(model=str(folder), **{**args, **kw})


def _spec(folder: Path, dfolder: Path, method: str) -> Engine:
    return _engine(folder, speculative="ngram" if method == "ngram" else f"draft:{dfolder}")


def _counts(eng: Engine) -> tuple[int, int]:
    c = eng.stats.spec
    return sum(x.draft_tokens for x in c.values()), sum(x.accepted_tokens for x in c.values())


def _all_free(eng: Engine) -> None:
    assert eng.states is not None and eng.states.num_free == eng.states.num_slots
    eng.assert_consistent()


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_identical_with_speculation(hybrid: tuple[Path, Path], method: str) -> None:
    """All prompts batched: tokens and logprobs with speculation are plain decoding's, bit for bit,
    while drafts were both accepted and rejected."""
    folder, dfolder = hybrid
    plain = _engine(folder)
    assert plain.runner.uses_kernels, "the CPU kernels (batch-invariant rows) are needed for a bitwise comparison"
    want = plain.generate(PROMPTS, PARAMS)
    eng = _spec(folder, dfolder, method)
    got = eng.generate(PROMPTS, PARAMS)
    drafted, accepted = _counts(eng)
    assert 0 < accepted < drafted, f"{method}: {accepted} of {drafted} draft tokens accepted (need both outcomes)"
    for i, (w, g) in enumerate(zip(want, got, strict=True)):
        assert g.token_ids == w.token_ids, f"{method} prompt {i}: tokens differ from plain decoding"
        assert [lp.logprob for lp in g.logprobs] == [lp.logprob for lp in w.logprobs], f"{method} prompt {i}: logprobs"
    _all_free(eng)


def _states_by_position(eng: Engine, prompt: list[int], others: list[list[int]]) -> dict[int, list[torch.Tensor]]:
    """Run ``prompt`` beside ``others`` step by step; after each step, the first request's state
    (every linear layer's tensors) keyed by its computed tokens."""
    states = eng.states
    assert states is not None
    eng.add_request(prompt, PARAMS, request_id="watched")
    for j, p in enumerate(others):
        eng.add_request(p, PARAMS, request_id=f"other{j}")
    req: Req = eng.admission.reqs["watched"]
    seen: dict[int, list[torch.Tensor]] = {}
    while eng.has_work:
        eng.step()
        if req.finished or req.state_slot is None or not req.output_ids:
            continue
        seen[req.computed] = [t[req.state_slot].clone() for layer in states.tensors for t in layer]
    return seen


def test_state_after_rollback_equals_plain_run(hybrid: tuple[Path, Path]) -> None:
    """After every step of a speculative run (accepted and rejected drafts), the request's
    recurrent state is bit for bit the state plain decoding has after the same tokens."""
    folder, dfolder = hybrid
    plain = _states_by_position(_engine(folder), PROMPTS[0], PROMPTS[1:3])
    eng = _spec(folder, dfolder, "ngram")
    spec = _states_by_position(eng, PROMPTS[0], PROMPTS[1:3])
    drafted, accepted = _counts(eng)
    assert 0 < accepted < drafted, f"{accepted} of {drafted} draft tokens accepted (need rollbacks)"
    assert len(spec) < len(plain)  # steps that kept several tokens
    for pos, tensors in spec.items():
        ref = plain[pos]
        for k, (a, b) in enumerate(zip(tensors, ref, strict=True)):
            assert torch.equal(a, b), f"state tensor {k} after {pos} tokens differs from plain decoding's"
    _all_free(eng)


def test_hybrid_refuses_mtp_self_and_hybrid_drafts(hybrid: tuple[Path, Path]) -> None:
    """What cannot follow the recurrent state is refused at start with the reason."""
    folder, _ = hybrid
    with pytest.raises(ValueError, match="--speculative mtp"):
        _engine(folder, speculative="mtp")
    with pytest.raises(ValueError, match="self:K"):
        _engine(folder, speculative="self:1")
    with pytest.raises(ValueError, match="a draft must be a model with attention layers only"):
        _engine(folder, speculative=f"draft:{folder}")


def test_jump_forward_on_hybrids_changes_nothing(hybrid: tuple[Path, Path]) -> None:
    """Jump-forward is on for hybrids: grammar-forced text verified as drafts,
    tokens and logprobs identical to decoding it token by token, beside unconstrained requests."""
    folder, _ = hybrid
    grammar = GrammarSpec("regex", "(abcdefg|hijklmn)( (abcdefg|hijklmn)){2,}")
    params = [SamplingParams(max_tokens=NEW, temperature=0.0, logprobs=0, grammar=grammar), PARAMS,
              SamplingParams(max_tokens=NEW, temperature=0.0, logprobs=0, grammar=grammar)]
    on, off = _engine(folder), _engine(folder, jump_forward=False)
    assert on.config.jump_forward
    a, b = on.generate(PROMPTS[:3], params), off.generate(PROMPTS[:3], params)
    assert on.stats.jump_forward_accepted > 0 and off.stats.jump_forward_proposed == 0
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert x.token_ids == y.token_ids, f"prompt {i}: tokens differ"
        assert [lp.logprob for lp in x.logprobs] == [lp.logprob for lp in y.logprobs], f"prompt {i}: logprobs"
    assert "".join(CHARS[t] for t in a[0].token_ids).startswith(("abcdefg", "hijklmn"))
    _all_free(on)


def test_prompt_logprobs_on_hybrids(hybrid: tuple[Path, Path]) -> None:
    """prompt_logprobs run on hybrids: a scoring pass of its own from the zero state (a scratch
    state slot), equal to transformers' log-softmax at every prompt position; a prompt resumed
    from the prefix cache gets them too, the same bit for bit."""
    folder, _ = hybrid
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    eng = _engine(folder)
    prompt = PROMPTS[2]
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    first = eng.generate([prompt], sp)[0]
    again = eng.generate([prompt + first.token_ids[:3]], sp)[0]
    assert again.cached_tokens > 0  # (resumed from the snapshot at the end of the first request)
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    got = first.prompt_logprobs
    assert got is not None and got[0] is None and len(got) == len(prompt)
    for j in range(1, len(prompt)):
        lp = got[j]
        assert lp is not None and lp.token_id == prompt[j]
        assert lp.logprob == pytest.approx(float(ref[j - 1, prompt[j]]), abs=2e-4), f"position {j}"
        assert len(lp.top) == 2
    assert again.prompt_logprobs is not None
    assert again.prompt_logprobs[: len(prompt)] == got  # (the scoring pass never starts from the cache)
    _all_free(eng)
