"""MiniMax (lightning attention beside GQA, a Mixtral MoE on every layer, weighted residuals on the
normed input) through the engine, token-exact against transformers.

A tiny random ``MiniMaxForCausalLM`` is built and saved with transformers; tripod loads the folder
and its greedy tokens are compared with transformers' (decoding with its own ``MiniMaxCache``) on the
same weights: each prompt alone, batched, with prefill chunks shorter than the prompts, and the next
turn resumed from the prefix cache (a state snapshot on a radix node).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import Greedy, check_greedy_tokens
from tripod import Engine, SamplingParams

VOCAB = 256
N_TOKENS = 10
CONFIG: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=512,
    full_attn_alpha_factor=1.5, full_attn_beta_factor=0.8, linear_attn_alpha_factor=0.9, linear_attn_beta_factor=1.2,
    mlp_alpha_factor=1.1, mlp_beta_factor=0.7, bos_token_id=1, eos_token_id=2,
)


class MiniMaxReference:
    """Greedy decoding with transformers' MiniMax and its own cache, never stopping at EOS."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.runs: dict[tuple[int, ...], Greedy] = {}

    @torch.inference_mode()
    def greedy(self, ids: list[int], n: int) -> Greedy:
        if tuple(ids) in self.runs:
            return self.runs[tuple(ids)]
        from transformers.models.minimax.modeling_minimax import MiniMaxCache

        cache = MiniMaxCache()
        out = self.model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True, logits_to_keep=1)
        tokens, margins, runner_up, logprobs = [], [], [], []
        for step in range(n):
            logits = out.logits[0, -1].float()
            top = logits.topk(2)
            tokens.append(int(top.indices[0]))
            margins.append(float(top.values[0] - top.values[1]))
            runner_up.append(int(top.indices[1]))
            logprobs.append(float(torch.log_softmax(logits, dim=-1)[tokens[-1]]))
            if step + 1 < n:
                out = self.model(input_ids=torch.tensor([[tokens[-1]]]), cache=cache, use_cache=True)
        run = Greedy(tokens, margins, runner_up, logprobs)
        self.runs[tuple(ids)] = run
        return run


def build_minimax(seed: int = 0, **overrides: Any) -> Any:
    """transformers' MiniMax (fp32, eval) with decisive random weights: unit-variance projections,
    norms around one."""
    from transformers import AutoModelForCausalLM, MiniMaxConfig

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(MiniMaxConfig(**{**CONFIG, **overrides}), dtype=torch.float32)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif p.ndim >= 2:
                std = 1.0 if "embed" in name else (3.0 if "lm_head" in name else 1.0) / math.sqrt(p.shape[-1])
                p.copy_(torch.randn(p.shape, generator=g) * std)
    model.eval()
    return model


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (37, 5, 22)]


PROMPTS = _prompts()
PARAMS = SamplingParams(max_tokens=N_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def minimax(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, MiniMaxReference]:
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    model = build_minimax()
    folder = tmp_path_factory.mktemp("minimax")
    model.save_pretrained(str(folder))
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="t0", pad_token="t0", bos_token="t1",
                            eos_token="t2").save_pretrained(str(folder))
    return folder, MiniMaxReference(model)


def _engine(folder: Path, **kw: Any) -> Engine:
    args: dict[str, Any] = dict(dtype="float32", kv_cache_tokens=1024, chunk_size=64, max_batch_tokens=128,
                                max_running=4, kernels="optimized")
    return Engine(model=str(folder), **{**args, **kw})


def _check_pools(eng: Engine) -> None:
    assert eng.model_config.architecture == "MiniMaxForCausalLM"
    assert eng.pool.kv.shape[0] == 2 and eng.states is not None  # layers 0 and 2 attend
    assert eng.states.spec.layers == (((4, 32, 32),),) * 2  # layers 1 and 3: [heads, d, d] each


def _check_next_turn(eng: Engine, ref: MiniMaxReference) -> None:
    """The first prompt, then the next turn (its prompt + answer + new text) resumed from the state
    snapshot left where the answer stopped: ``cached_tokens`` all but the answer's last token."""
    (first,) = eng.generate([PROMPTS[0]], PARAMS)
    check_greedy_tokens(first.token_ids, ref.greedy(PROMPTS[0], N_TOKENS), "first turn")
    turn = PROMPTS[0] + first.token_ids + PROMPTS[1]
    (ext,) = eng.generate([turn], PARAMS)
    assert ext.cached_tokens == len(PROMPTS[0]) + N_TOKENS - 1
    check_greedy_tokens(ext.token_ids, ref.greedy(turn, N_TOKENS), "next turn from the prefix cache")
    eng.assert_consistent()


def test_minimax_chunked_and_cached_match_transformers(minimax: tuple[Path, MiniMaxReference]) -> None:
    """6-token prefill chunks, then the next turn from the prefix cache: transformers' tokens."""
    folder, ref = minimax
    eng = _engine(folder, chunk_size=6, max_batch_tokens=16)
    _check_pools(eng)
    _check_next_turn(eng, ref)


@pytest.mark.slow  # about 60 s on 2 cores
def test_minimax_alone_batched_chunked_match_transformers(minimax: tuple[Path, MiniMaxReference]) -> None:
    """Every prompt alone, batched and with 6-token chunks: transformers' greedy tokens."""
    folder, ref = minimax
    eng = _engine(folder)
    for i, p in enumerate(PROMPTS):
        check_greedy_tokens(eng.generate([p], PARAMS)[0].token_ids, ref.greedy(p, N_TOKENS), f"prompt {i} alone")
    for i, out in enumerate(eng.generate(PROMPTS, PARAMS)):
        check_greedy_tokens(out.token_ids, ref.greedy(PROMPTS[i], N_TOKENS), f"prompt {i} batched")
    for i, out in enumerate(_engine(folder, chunk_size=6, max_batch_tokens=16).generate(PROMPTS, PARAMS)):
        check_greedy_tokens(out.token_ids, ref.greedy(PROMPTS[i], N_TOKENS), f"prompt {i} chunked")
    eng.assert_consistent()


def test_minimax_refuses_a_sliding_window() -> None:
    from tripod.models.config import ModelConfig

    d = dict(architectures=["MiniMaxForCausalLM"], model_type="minimax", **CONFIG)
    assert ModelConfig.from_hf_dict(d).hybrid is not None
    with pytest.raises(ValueError, match="sliding_window"):
        ModelConfig.from_hf_dict({**d, "sliding_window": 16})
