"""Shared fixtures for the integration tests on the real embedded model (SmolLM2-135M, Q4_1 GGUF).

Loading is the expensive part (~6 s for a tripod engine, ~15 s for the Hugging Face reference),
so everything here is session-scoped and loaded lazily: a unit test that asks for none of these
fixtures pays nothing.

- ``base_engine``: one fp32 tripod ``Engine`` for the whole session. Tests take it through the
  function-scoped ``engine`` fixture, which checks afterwards that the engine is idle and that
  the KV ownership invariant holds (``assert_consistent``).
- ``make_engine``: more engines with other settings, sharing ``base_engine``'s loaded weights.
- ``hf_model`` / ``hf_tokenizer``: the independent reference, Hugging Face transformers in fp32
  on the same dequantized GGUF weights.
- ``hf_ref``: greedy decoding with the reference, cached per (prompt, length).
- ``check_greedy``: compares greedy token ids with a reference, allowing a divergence only at a
  near tie (reference top-2 logit margin < ``NEAR_TIE``), and saying so when it happens.
"""

from __future__ import annotations

import inspect
import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch

# The reference must never reach for the hub: everything it needs is in the GGUF.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

NEAR_TIE = 2e-3  # a greedy divergence is tolerated only where the reference's top-2 margin is below
BASE_KV_TOKENS = 8192


class NearTieDivergence(UserWarning):
    """A greedy divergence from the reference at a near tie (allowed, but reported)."""


@dataclass(frozen=True, slots=True)
class Greedy:
    """A greedy reference run: the chosen tokens and, at each step, how close the call was."""

    tokens: list[int]
    margins: list[float]  # top-1 minus top-2 logit (equivalently logprob) at each step
    runner_up: list[int]  # the second-best token at each step
    logprobs: list[float]  # log-softmax of the chosen token at each step

    def head(self, n: int) -> Greedy:
        """The first ``n`` steps."""
        return Greedy(self.tokens[:n], self.margins[:n], self.runner_up[:n], self.logprobs[:n])

    @classmethod
    def from_tripod(cls, out: Any) -> Greedy:
        """From a tripod ``RequestOutput`` of a greedy run made with ``logprobs >= 2``."""
        assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
        margins, runner_up = [], []
        for lp in out.logprobs:
            assert len(lp.top) >= 2, "the reference run needs logprobs >= 2"
            margins.append(lp.top[0][1] - lp.top[1][1])
            runner_up.append(lp.top[1][0])
        return cls(list(out.token_ids), margins, runner_up, [lp.logprob for lp in out.logprobs])


def check_greedy_tokens(got: Sequence[int], ref: Greedy, what: str, *, tol: float = NEAR_TIE) -> int:
    """Assert ``got`` equals ``ref.tokens`` token for token.

    A divergence is accepted only where the reference's top-2 margin is below ``tol`` and
    ``got`` picked the reference's runner-up; it is then reported (warning + print) and the rest
    is not compared, since after a different token the two continuations legitimately differ.
    Returns how many tokens were compared equal.
    """
    got = list(got)
    assert len(got) == len(ref.tokens), (
        f"{what}: {len(got)} tokens but the reference has {len(ref.tokens)}\n"
        f"  got: {got}\n  ref: {ref.tokens}"
    )
    for i, (a, b) in enumerate(zip(got, ref.tokens, strict=True)):
        if a == b:
            continue
        margin = ref.margins[i]
        assert margin < tol and a == ref.runner_up[i], (
            f"{what}: token {i} is {a} but the reference chose {b} with a top-2 margin of "
            f"{margin:.3g} (runner-up {ref.runner_up[i]}); only a near tie (< {tol}) may diverge\n"
            f"  got: {got}\n  ref: {ref.tokens}"
        )
        msg = (
            f"{what}: diverged from the reference at token {i} at a near tie (reference top-2 "
            f"margin {margin:.2e} < {tol}; {a} is the reference's runner-up); "
            f"the {len(got) - i - 1} tokens after it are not compared"
        )
        print(msg)
        warnings.warn(msg, NearTieDivergence, stacklevel=2)
        return i
    return len(got)


# ---------------------------------------------------------------------------------- tripod
@pytest.fixture(scope="session")
def base_engine() -> Any:
    from tripod import Engine

    return Engine(dtype="float32", kv_cache_tokens=BASE_KV_TOKENS)


@pytest.fixture
def engine(base_engine: Any) -> Iterator[Any]:
    """The shared fp32 engine; after the test it must be idle and its KV accounted for."""
    base_engine.assert_consistent()
    yield base_engine
    assert not base_engine.has_work, (
        f"the test left work queued: waiting={base_engine.scheduler.waiting} "
        f"running={base_engine.scheduler.running}"
    )
    base_engine.assert_consistent()


@pytest.fixture(scope="session")
def make_engine(base_engine: Any) -> Callable[..., Any]:
    """``make_engine(**overrides)``: an engine with ``base_engine``'s config changed by
    ``overrides``, reusing its loaded fp32 weights (no reload)."""
    from tripod import Engine

    def make(**overrides: Any) -> Any:
        overrides.setdefault("kv_cache_tokens", 4096)
        return Engine(config=base_engine.config, loaded=base_engine.loaded, **overrides)

    return make


@pytest.fixture(scope="session")
def check_greedy() -> Callable[..., int]:
    return check_greedy_tokens


@pytest.fixture(scope="session")
def greedy_from_tripod() -> Callable[[Any], Greedy]:
    return Greedy.from_tripod


@pytest.fixture(scope="session")
def chat(base_engine: Any) -> Callable[..., list[int]]:
    """``chat("question", system=None)``: chat-templated prompt ids."""

    def make(user: str, system: str | None = None) -> list[int]:
        msgs = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": user}
        ]
        return list(base_engine.apply_chat_template(msgs))

    return make


# ---------------------------------------------------------------------------------- reference
@pytest.fixture(scope="session")
def gguf_path() -> Any:
    from tripod.loader.embedded import embedded_model_path

    return embedded_model_path()


@pytest.fixture(scope="session")
def hf_model(gguf_path: Any) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    )
    model.eval()
    return model


@pytest.fixture(scope="session")
def hf_tokenizer(gguf_path: Any) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


class HFReference:
    """Greedy decoding with the Hugging Face model, one token at a time with its KV cache, never
    stopping at EOS (the equivalent of tripod's ``ignore_eos=True``). Results are cached."""

    def __init__(self, model: Any) -> None:
        self.model = model
        params = inspect.signature(model.forward).parameters
        # transformers 5 renamed ``past_key_values`` to ``cache``.
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._runs: dict[tuple[tuple[int, ...], int], Greedy] = {}

    @torch.inference_mode()
    def greedy(self, ids: Sequence[int], n: int) -> Greedy:
        key = (tuple(ids), n)
        if key in self._runs:
            return self._runs[key]
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        kw = {self._cache_kw: cache, "use_cache": True}
        out = self.model(input_ids=torch.tensor([list(ids)]), logits_to_keep=1, **kw)
        tokens: list[int] = []
        margins: list[float] = []
        runner_up: list[int] = []
        logprobs: list[float] = []
        for step in range(n):
            logits = out.logits[0, -1].float()
            top = logits.topk(2)
            tok = int(top.indices[0])
            tokens.append(tok)
            margins.append(float(top.values[0] - top.values[1]))
            runner_up.append(int(top.indices[1]))
            logprobs.append(float(torch.log_softmax(logits, dim=-1)[tok]))
            if step + 1 < n:
                out = self.model(input_ids=torch.tensor([[tok]]), **kw)
        run = Greedy(tokens, margins, runner_up, logprobs)
        self._runs[key] = run
        return run


@pytest.fixture(scope="session")
def hf_ref(hf_model: Any) -> HFReference:
    return HFReference(hf_model)


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One real ``tripod serve`` (fp32, embedded model) for the end-to-end tests."""
    from tests.support.server_helpers import ServerProcess

    srv = ServerProcess(tmp_path_factory.mktemp("serve"))
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="session")
def tiny_vlm(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Any]:
    """``tiny_vlm(kind)``: a tiny random vision-language checkpoint of ``kind`` saved to a folder,
    with its transformers model and processor (``tests/support/tiny_vlms.py``), built once per session."""
    from tests.support import tiny_vlms

    made: dict[str, Any] = {}

    def get(kind: str) -> Any:
        if kind not in made:
            made[kind] = tiny_vlms.build(kind, tmp_path_factory.mktemp(kind.replace("_", "-")))
        return made[kind]

    return get
