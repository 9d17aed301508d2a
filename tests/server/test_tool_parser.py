"""Tool calling without a model: the Hermes parser (streamed = whole, whatever the chunking), its
grammars under XGrammar with the embedded tokenizer (every mode accepts exactly what it should),
and the generic prompt format."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tripod.server.answer.conversation import ChatRenderer, Message, PastCall
from tripod.server.answer.tools import (
    ArgsPiece,
    CallEnd,
    CallStart,
    HermesParser,
    ParsedAnswer,
    TextPiece,
    ToolChoice,
    ToolSpec,
    check_choice,
    check_tools,
    parse_all,
)
from tripod.server.errors import APIError

P = HermesParser()
WEATHER = ToolSpec("get_weather", "Weather in a city", {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["C", "F"]}},
    "required": ["city", "unit"]})
CLOCK = ToolSpec("get_time", None, {"type": "object", "properties": {}})


def call(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


A = call("get_weather", '{"city": "Pa\\"ris}", "unit": "C", "n": [1, {"x": [2]}]}')
B = call("get_time", "{}")
TEXTS = [
    "Plain text, no calls.  ",
    "Let me check.\n" + A,
    A + "\n" + B,
    A + "\n" + B + "\n",
    "x " + A[:60],  # cut inside the arguments (max_tokens)
    "x " + A[:20],  # cut before the name is complete: no call at all
    "a <tool_c",
    "see <tool_call> not a call </tool_call> ok",
    '<tool_call>\n{"arguments": {"a": 1}, "name": "other"}\n</tool_call>',  # another key order
    "<tool_call>",
]


def ids() -> Any:
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def summary(a: ParsedAnswer) -> tuple[str, list[tuple[str, str, bool]]]:
    return a.text, [(c.name, c.arguments, c.complete) for c in a.calls]


def test_whole_answers_parse() -> None:
    got = {t: summary(parse_all(P, t, ids())) for t in TEXTS}
    assert got[TEXTS[0]] == ("Plain text, no calls.  ", [])
    assert got[TEXTS[1]] == ("Let me check.", [("get_weather", '{"city": "Pa\\"ris}", "unit": "C", "n": [1, {"x": [2]}]}', True)])
    assert got[TEXTS[2]][0] == "" and [c[0] for c in got[TEXTS[2]][1]] == ["get_weather", "get_time"]
    assert got[TEXTS[3]] == got[TEXTS[2]]
    assert got[TEXTS[4]][0] == "x" and got[TEXTS[4]][1][0][2] is False
    assert got[TEXTS[5]] == ("x", [])
    assert got[TEXTS[6]] == ("a <tool_c", [])
    assert got[TEXTS[7]] == ("see <tool_call> not a call </tool_call> ok", [])
    assert got[TEXTS[8]] == ("", [("other", '{"a": 1}', True)])
    assert got[TEXTS[9]] == ("", [])
    for t in TEXTS:
        for c in parse_all(P, t, ids()).calls:
            if c.complete:
                json.loads(c.arguments)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(TEXTS), st.lists(st.integers(1, 12), min_size=1, max_size=200))
def test_streaming_agrees_with_whole_whatever_the_chunks(text: str, cuts: list[int]) -> None:
    whole = summary(parse_all(P, text, ids()))
    s = P.stream(ids())
    ans = ParsedAnswer()
    events = []
    i = 0
    for n in itertools.cycle(cuts):
        if i >= len(text):
            break
        ev = s.feed(text[i : i + n])
        events += ev
        ans.add(ev)
        i += n
    ev = s.finish()
    events += ev
    ans.add(ev)
    assert summary(ans) == whole
    # Every call is announced (id, name) before its argument pieces, and ended once.
    started: set[int] = set()
    for e in events:
        if isinstance(e, CallStart):
            assert e.index not in started
            started.add(e.index)
        elif isinstance(e, ArgsPiece | CallEnd):
            assert e.index in started
    assert sum(isinstance(e, CallEnd) for e in events) == len(started)
    assert all(not isinstance(e, TextPiece) or e.text for e in events)


def test_tool_and_choice_checks() -> None:
    tools = check_tools([("f", None, None), ("g", "d", {"type": "object"})], "tools")
    assert tools[0].parameters == {"type": "object", "properties": {}}
    with pytest.raises(APIError, match="used twice"):
        check_tools([("f", None, None), ("f", None, None)], "tools")
    with pytest.raises(APIError, match="letters"):
        check_tools([("bad name!", None, None)], "tools")
    with pytest.raises(APIError, match="JSON schema"):
        check_tools([("f", None, [1])], "tools")
    with pytest.raises(APIError, match="not among"):
        check_choice(ToolChoice("named", "nope"), tools, "tool_choice")
    with pytest.raises(APIError, match="no tools"):
        check_choice(ToolChoice("required"), [], "tool_choice")


# ---------------------------------------------------------------------- grammars under XGrammar
@pytest.fixture(scope="module")
def backend() -> Any:
    from tripod.engine.structured import GrammarBackend
    from tripod.loader import load_tokenizer

    tok = load_tokenizer(None)
    return GrammarBackend(tok.tokenizer, tok.config.vocab_size, frozenset({2}))


def _accepts(backend: Any, choice: ToolChoice, text: str) -> bool:
    spec = P.grammar([WEATHER, CLOCK], choice)
    assert spec is not None and spec.kind == "structural_tag"
    m = backend.matcher(backend.compile_now(spec))
    if text and not m.accept_string(text):
        return False
    return bool(m.accept_token(2) and m.is_terminated())


W = call("get_weather", '{"city": "Paris", "unit": "C"}')
T = call("get_time", "{}")


@pytest.mark.parametrize(("choice", "text", "ok"), [
    (ToolChoice("auto"), "", True),
    (ToolChoice("auto"), "Just text.", True),
    (ToolChoice("auto"), "Checking. " + W, True),
    (ToolChoice("auto"), W + "\n" + T, True),
    (ToolChoice("auto", parallel=False), W + "\n" + T, False),
    (ToolChoice("auto"), W + " and then more text", False),
    (ToolChoice("auto"), call("get_weather", '{"city": "Paris"}'), False),  # a required key missing
    (ToolChoice("auto"), call("get_weather", '{"city": "Paris", "unit": "K"}'), False),  # not in the enum
    (ToolChoice("auto"), call("get_weather", '{"city":"Paris", "unit": "C"}'), False),  # the grammar's layout only
    (ToolChoice("auto"), call("nope", "{}"), False),
    (ToolChoice("required"), "", False),
    (ToolChoice("required"), "text " + W, False),
    (ToolChoice("required"), W, True),
    (ToolChoice("required"), W + "\n" + T + "\n" + W, True),
    (ToolChoice("required", parallel=False), W + "\n" + T, False),
    (ToolChoice("named", "get_time"), T, True),
    (ToolChoice("named", "get_time"), W, False),
    (ToolChoice("named", "get_time"), T + "\n" + T, False),
])
def test_grammar_modes(backend: Any, choice: ToolChoice, text: str, ok: bool) -> None:
    assert _accepts(backend, choice, text) is ok


def test_required_grammar_forces_the_call_start(backend: Any) -> None:
    """Jump-forward has the whole call opening to verify at once."""
    spec = P.grammar([WEATHER], ToolChoice("required", parallel=False))
    assert spec is not None
    m = backend.matcher(backend.compile_now(spec))
    assert m.find_jump_forward_string() == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "'
    assert P.grammar([WEATHER], ToolChoice("none")) is None


def test_bad_schema_is_a_grammar_error(backend: Any) -> None:
    from tripod.engine.structured import GrammarError

    spec = P.grammar([ToolSpec("f", None, {"type": "object", "properties": {"a": {"type": "foo"}}})],
                     ToolChoice("required"))
    assert spec is not None
    with pytest.raises(GrammarError, match="foo"):
        backend.compile_now(spec)


# ---------------------------------------------------------------------- the generic prompt format
class _FakeText:
    template = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"

    def __init__(self) -> None:
        self.seen: list[Any] = []

    def chat(self, messages: list[dict[str, Any]], **kw: Any) -> list[int]:
        self.seen.append((messages, kw))
        return [1]


def test_generic_prompt_renders_tools_calls_and_results() -> None:
    text = _FakeText()
    r = ChatRenderer(text)  # type: ignore[arg-type]
    assert r.describe()["prompt_format"] == "generic" and not r.parallel_default
    msgs = [
        Message("system", "Be brief."),
        Message("user", "Weather in Paris and the time?"),
        Message("assistant", "", [PastCall("c1", "get_weather", '{"city":"Paris","unit":"C"}'),
                                  PastCall("c2", "get_time", "{}")]),
        Message("tool", "18 C", tool_call_id="c1"),
        Message("tool", "noon", tool_call_id="c2"),
    ]
    r.render(msgs, [WEATHER, CLOCK])
    out, kw = text.seen[-1]
    assert not kw.get("tools")  # the template knows no tools: they are in the system message
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.\n\n") and '"name": "get_weather"' in out[0]["content"]
    # Earlier calls are written exactly as the grammar makes the model write them.
    assert out[2]["content"] == W + "\n" + T
    assert out[3]["content"] == "<tool_response>\n18 C\n</tool_response>\n<tool_response>\nnoon\n</tool_response>"


def test_native_template_gets_tools_and_structured_calls() -> None:
    text = _FakeText()
    text.template = "{% if tools %}...{% endif %}<tool_call>"
    r = ChatRenderer(text)  # type: ignore[arg-type]
    assert r.native_tools and r.parallel_default
    r.render([Message("user", "hi"), Message("assistant", "", [PastCall("c1", "get_time", '{"a": 1}')])], [CLOCK])
    out, kw = text.seen[-1]
    assert kw["tools"] == [CLOCK.openai()]
    assert out[1]["tool_calls"] == [{"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": {"a": 1}}}]
