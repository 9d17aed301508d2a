"""Speculative decoding and jump-forward on Kimi Linear (KDA beside MLA) and MiniMax (lightning
attention beside GQA): lossless, with exact rollback of the linear layers' state.

As ``tests/models/test_hybrid_speculative.py`` (whose helpers this reuses): the KDA and lightning
mixers keep their state after every verified row (``memory/state_pool.StateTrace``: copies of the
tensors each token step produced), and the engine puts back the state after the last accepted row.
Tiny random checkpoints with the layers' output projections scaled down, so greedy text falls into
cycles that n-gram and a draft sharing the target's embeddings guess in part: drafts are both
accepted and rejected (asserted).

What is asserted, and why not more: greedy tokens equal plain decoding's. Logprobs and states are
not bit for bit across the two runs on these models whatever the rollback does: Kimi's MLA runs on
torch's ops, whose sums depend on how many rows share a call (a verify item's ``k + 1`` rows vs a
decode row), and both models' MoE groups a step's rows per expert, so plain decoding alone vs
batched already differs (~2e-6 in logprobs, measured). So: logprobs within ``LOGPROB_TOL``; the
first layer (linear in both tiny models: its input is the embeddings alone) has plain decoding's
state bit for bit after every step, the deeper linear layer's to float32 rounding (a rejected draft
left in the state would be off by far more). The traces themselves are bit-exact per row
(``tests/layers/test_kda.py``, ``tests/layers/test_lightning.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.models.test_hybrid_speculative import (
    CHARS,
    NEW,
    PARAMS,
    PROMPTS,
    V,
    _all_free,
    _counts,
    _engine,
    _spec,
    _states_by_position,
    _tokenizer,
)
from tests.models.test_kimi_linear import build_kimi
from tests.models.test_minimax import build_minimax
from tripod import SamplingParams
from tripod.engine.request import GrammarSpec

transformers = pytest.importorskip("transformers")


def _scaled(model: Any, scale: float) -> Any:
    """The mixers' and MLPs' output projections scaled by ``scale`` (the module docstring)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight", "w2.weight")) or (
                    name.endswith("experts.down_proj")):
                p.mul_(scale)
    return model


def _kimi() -> Any:
    return _scaled(build_kimi(seed=3, vocab_size=V), 0.3)


def _minimax() -> Any:
    # the first layer linear (as Kimi's): its state depends on the embeddings alone (module docstring)
    types = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
    return _scaled(build_minimax(seed=3, vocab_size=V, layer_types=types), 0.3)


BUILD: dict[str, Callable[[], Any]] = {"kimi_linear": _kimi, "minimax": _minimax}
# Logprobs of speculative vs plain decoding: equal to float32 rounding, not bit for bit (module
# docstring; measured: 1.5e-6 apart at most, and plain decoding alone vs batched 2e-6 apart).
LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module", params=list(BUILD))
def hybrid(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, Path]:
    """(the family, its folder, a one-layer Llama draft's folder sharing its embeddings and head)."""
    folder = tmp_path_factory.mktemp(request.param)
    target = BUILD[request.param]()
    target.save_pretrained(str(folder))
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
    return request.param, folder, dfolder


def _same_logprobs(got: Any, want: Any, what: str) -> None:
    a, b = [lp.logprob for lp in got.logprobs], [lp.logprob for lp in want.logprobs]
    assert a == pytest.approx(b, abs=LOGPROB_TOL), f"{what}: logprobs"


@pytest.mark.parametrize("method", ["ngram", pytest.param("draft", marks=pytest.mark.slow)])
def test_greedy_identical_with_speculation(hybrid: tuple[str, Path, Path], method: str) -> None:
    """All prompts batched: the tokens with speculation are plain decoding's (logprobs equal to
    rounding), while drafts were both accepted and rejected."""
    family, folder, dfolder = hybrid
    plain = _engine(folder)
    assert not plain.config.speculative and plain.config.jump_forward
    want = plain.generate(PROMPTS, PARAMS)
    eng = _spec(folder, dfolder, method)
    got = eng.generate(PROMPTS, PARAMS)
    drafted, accepted = _counts(eng)
    assert 0 < accepted < drafted, f"{family} {method}: {accepted} of {drafted} draft tokens accepted (need both)"
    for i, (w, g) in enumerate(zip(want, got, strict=True)):
        assert g.token_ids == w.token_ids, f"{family} {method} prompt {i}: tokens differ from plain decoding"
        _same_logprobs(g, w, f"{family} {method} prompt {i}")
    _all_free(eng)


def test_state_after_rollback_equals_plain_run(hybrid: tuple[str, Path, Path]) -> None:
    """After every step of a speculative run (accepted and rejected drafts), the request's state is
    the state plain decoding has after the same tokens: bit for bit in the first (linear) layer,
    whose input is the embeddings alone; to float32 rounding in the deeper one (module docstring).
    A rejected draft left in the state would be off by far more."""
    family, folder, dfolder = hybrid
    plain = _states_by_position(_engine(folder), PROMPTS[0], PROMPTS[1:3])
    eng = _spec(folder, dfolder, "ngram")
    assert eng.states is not None
    first_layer = len(eng.states.tensors[0])  # (the first linear layer's tensors)
    spec = _states_by_position(eng, PROMPTS[0], PROMPTS[1:3])
    drafted, accepted = _counts(eng)
    assert 0 < accepted < drafted, f"{family}: {accepted} of {drafted} draft tokens accepted (need rollbacks)"
    assert len(spec) < len(plain)  # steps that kept several tokens
    for pos, tensors in spec.items():
        ref = plain[pos]
        for k, (a, b) in enumerate(zip(tensors, ref, strict=True)):
            if k < first_layer:
                assert torch.equal(a, b), f"{family}: state tensor {k} after {pos} tokens differs from plain decoding's"
            else:
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=f"{family}: state tensor {k} after {pos} tokens")
    _all_free(eng)


def test_jump_forward_changes_nothing(hybrid: tuple[str, Path, Path]) -> None:
    """Jump-forward is on: grammar-forced text verified as drafts beside unconstrained requests,
    the tokens of decoding it token by token (logprobs equal to rounding)."""
    family, folder, _ = hybrid
    grammar = GrammarSpec("regex", "(abcdefg|hijklmn)( (abcdefg|hijklmn)){2,}")
    params = [SamplingParams(max_tokens=NEW, temperature=0.0, logprobs=0, grammar=grammar), PARAMS,
              SamplingParams(max_tokens=NEW, temperature=0.0, logprobs=0, grammar=grammar)]
    on, off = _engine(folder), _engine(folder, jump_forward=False)
    assert on.config.jump_forward
    a, b = on.generate(PROMPTS[:3], params), off.generate(PROMPTS[:3], params)
    assert on.stats.jump_forward_accepted > 0 and off.stats.jump_forward_proposed == 0
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert x.token_ids == y.token_ids, f"{family} prompt {i}: tokens differ"
        _same_logprobs(x, y, f"{family} prompt {i}")
    assert "".join(CHARS[t] for t in a[0].token_ids).startswith(("abcdefg", "hijklmn"))
    _all_free(on)
