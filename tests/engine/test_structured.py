"""Structured outputs on the real model: every output matches its constraint; mixed batches are
exact; invalid constraints are clear errors."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest

from tests.support.structured_suite import CHOICES, EBNF, REGEXES, SCHEMAS, json_prompt, text_prompt
from tripod.engine.request import SamplingParams
from tripod.engine.structured import GrammarSpec

MAX_TOKENS = 160


def _json_params(schema: dict[str, Any], **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0, grammar=GrammarSpec("json", json.dumps(schema)), **kw)


def test_schema_suite_outputs_parse_and_validate(engine: Any) -> None:
    assert len(SCHEMAS) >= 20
    names = list(SCHEMAS)
    prompts = [engine.apply_chat_template(json_prompt(n, SCHEMAS[n])) for n in names]
    outs = engine.generate(prompts, [_json_params(SCHEMAS[n]) for n in names])
    for name, out in zip(names, outs, strict=True):
        assert out.finish_reason == "stop", (name, out.text)
        value = json.loads(out.text)
        jsonschema.validate(value, SCHEMAS[name])


def test_regex_choice_and_ebnf_outputs_match(engine: Any) -> None:
    specs: list[tuple[str, GrammarSpec, str]] = []
    for name, rx in REGEXES.items():
        specs.append((name, GrammarSpec("regex", rx), f"Give an example of a {name} value."))
    for name, ch in CHOICES.items():
        specs.append((name, GrammarSpec("choice", json.dumps(ch)), f"Answer the {name} question with one word."))
    specs.append(("ebnf", GrammarSpec("ebnf", EBNF), "Write an arithmetic expression."))
    prompts = [engine.apply_chat_template(text_prompt(q)) for _, _, q in specs]
    outs = engine.generate(prompts, [SamplingParams(max_tokens=60, temperature=0, grammar=g) for _, g, _ in specs])
    for (name, g, _), out in zip(specs, outs, strict=True):
        assert out.finish_reason == "stop", (name, out.text)
        if g.kind == "regex":
            assert re.fullmatch(g.value, out.text), (name, out.text)
        elif g.kind == "choice":
            assert out.text in json.loads(g.value), (name, out.text)
        else:
            assert _parses_arithmetic(out.text), out.text


def _parses_arithmetic(s: str) -> bool:
    pos = 0

    def number() -> bool:
        nonlocal pos
        m = re.compile(r"[1-9][0-9]?").match(s, pos)
        if not m:
            return False
        pos = m.end()
        return True

    def factor() -> bool:
        nonlocal pos
        if s.startswith("(", pos):
            pos += 1
            if not expr() or not s.startswith(")", pos):
                return False
            pos += 1
            return True
        return number()

    def chain(sub: Any, ops: str) -> bool:
        nonlocal pos
        if not sub():
            return False
        while pos < len(s) and s[pos] in ops:
            pos += 1
            if not sub():
                return False
        return True

    def term() -> bool:
        return chain(factor, "*/")

    def expr() -> bool:
        return chain(term, "+-")

    return expr() and pos == len(s)


@pytest.mark.slow
def test_mixed_batch_matches_each_request_alone(engine: Any) -> None:
    """Constrained and free requests in one batch give the tokens each gives alone."""
    free = engine.apply_chat_template(text_prompt("Write a sentence about the sea."))
    js = engine.apply_chat_template(json_prompt("person", SCHEMAS["person"]))
    rx = engine.apply_chat_template(text_prompt("Give an example of a phone value."))
    params = [
        SamplingParams(max_tokens=40, temperature=0),
        _json_params(SCHEMAS["person"]),
        SamplingParams(max_tokens=40, temperature=0, grammar=GrammarSpec("regex", REGEXES["phone"])),
        SamplingParams(max_tokens=40, temperature=0.9, seed=7),
    ]
    prompts = [free, js, rx, free]
    together = engine.generate(prompts, params)
    for p, sp, out in zip(prompts, params, together, strict=True):
        alone = engine.generate(p, sp)[0]
        assert alone.token_ids == out.token_ids, (alone.text, out.text)


def test_sampling_n_seed_logprobs_and_prefix_cache(engine: Any) -> None:
    schema = SCHEMAS["exclusive-bounds"]
    prompt = engine.apply_chat_template(json_prompt("levels", schema))
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=11, n=4, logprobs=2,
                        grammar=GrammarSpec("json", json.dumps(schema)))
    a = engine.generate(prompt, sp)
    b = engine.generate(prompt, sp)  # the second run's prompt comes from the prefix cache
    assert b[1].cached_tokens > 0
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    for o in a:
        assert o.finish_reason == "stop"
        jsonschema.validate(json.loads(o.text), schema)
        assert o.logprobs is not None and len(o.logprobs) == len(o.token_ids)
        # Logprobs are of the masked distribution: where the grammar forces a token (a key name,
        # the stop token after the closing brace) it has probability 1 and the runner-up none.
        forced = [lp for lp in o.logprobs if lp.logprob > -1e-5]
        assert forced and all(lp.top[1][1] == float("-inf") for lp in forced)
        assert o.logprobs[-1] in forced


@pytest.mark.parametrize(("kind", "value", "words"), [
    ("json", json.dumps({"type": "foo"}), "Unsupported type"),
    ("json", "{not json", "invalid JSON schema"),
    ("json", json.dumps({"type": "object", "properties": {"a": {"$ref": "#/nope"}}}), "nope"),
    ("regex", "a(b", "parenthesis"),
    ("ebnf", "root ::= undefined_rule", "undefined_rule"),
    ("choice", "[]", "choice"),
])
def test_invalid_constraints_are_clear_errors(engine: Any, kind: str, value: str, words: str) -> None:
    prompt = engine.encode("Hello")
    with pytest.raises(ValueError, match=re.escape(words)):
        engine.generate(prompt, SamplingParams(grammar=GrammarSpec(kind, value)))
    # The streaming (background-compile) path reports the same as a rejected request.
    deltas = list(engine.stream(prompt, SamplingParams(grammar=GrammarSpec(kind, value))))
    assert deltas[-1].finish_reason == "rejected" and words in (deltas[-1].error or "")


def test_compile_timeout_rejects_and_others_still_compile(engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A grammar whose compile never ends is rejected after the timeout; requests queued behind
    it on the compile thread still get compiled and served, and free requests keep decoding."""
    import threading

    backend = engine.grammars
    release = threading.Event()
    real = backend._compile

    def compile_or_hang(spec: GrammarSpec) -> Any:
        if spec.value == "HANG":
            release.wait(60)  # a stand-in for a pathological grammar
        return real(spec)

    monkeypatch.setattr(backend, "_compile", compile_or_hang)
    monkeypatch.setattr(backend, "compile_timeout", 0.5)
    prompt = engine.encode("The answer is")
    try:
        hang = engine.add_request(prompt, SamplingParams(grammar=GrammarSpec("regex", "HANG")))[0]
        ok = engine.add_request(prompt, SamplingParams(max_tokens=8, grammar=GrammarSpec("regex", "(yes|no)")))[0]
        free = engine.add_request(prompt, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0]
        while engine.pending:
            engine.step()
    finally:
        release.set()
    assert hang.finish_reason == "rejected" and "longer than" in (hang.error or "")
    assert ok.finish_reason == "stop" and engine.decode(ok.output_ids) in ("yes", "no")
    assert free.finish_reason == "length" and len(free.output_ids) == 30
