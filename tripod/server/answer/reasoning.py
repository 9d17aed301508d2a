"""Reasoning output: the model's thinking split out of its answer, shared by both APIs.

A ``ReasoningParser`` owns one thinking syntax:

- ``deepseek_r1`` / ``qwen3``: ``<think>…</think>`` then the answer. DeepSeek-R1's template opens
  the thinking inside the prompt, so its output may begin without ``<think>``: R1 starts in the
  thinking unless the prompt closed it; Qwen3 thinks only when its output (or the prompt's end)
  opens a ``<think>`` block.
- ``gpt_oss``: harmony channels, ``<|channel|>analysis<|message|>…<|end|>`` (the thinking) then
  ``<|start|>assistant<|channel|>final<|message|>…`` (the answer), read as text.

It does two jobs: ``stream`` splits the model's text into (reasoning, answer) pieces as it comes
(whole answers are the same parser fed at once, so streamed and whole answers agree, and the
markers never reach either part); ``grammar`` wraps an answer constraint (structured output, tool
calls) so that it starts at the end of the thinking: free text up to the closing marker, then the
constraint. A thinking budget (Anthropic's ``thinking.budget_tokens``, tripod's
``thinking_budget``) caps the free text, after which the closing marker is forced.

Where the output starts (``start``) is read from the end of the rendered prompt: a prompt ending in
``<think>`` starts in the thinking, one ending in ``</think>`` (thinking switched off by the
template) in the answer; otherwise the parser's own default.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from tripod.config_services import REASONING_PARSERS
from tripod.protocol.sampling import GrammarSpec

Start = Literal["thinking", "maybe", "answer"]


@dataclass(frozen=True, slots=True)
class Split:
    """What a piece of the model's text adds to the thinking and to the answer."""

    reasoning: str = ""
    content: str = ""

    def __add__(self, other: Split) -> Split:
        return Split(self.reasoning + other.reasoning, self.content + other.content)


class ReasoningStream(ABC):
    """Incremental splitter of one answer: ``feed`` text as it comes, ``finish`` at the end."""

    @abstractmethod
    def feed(self, text: str) -> Split: ...

    @abstractmethod
    def finish(self) -> Split: ...


class ReasoningParser(ABC):
    """One thinking syntax: where an output starts, its splitter, and its grammar wrapper."""

    name: ClassVar[str]
    open: ClassVar[str]
    close: ClassVar[str]
    default_start: ClassVar[Start]
    special_tokens: ClassVar[bool] = False  # the markers are special tokens the text must keep

    def start(self, prompt_text: str) -> Start:
        tail = prompt_text.rstrip()
        if tail.endswith(self.close):
            return "answer"
        if tail.endswith(self.open):
            return "thinking"
        return self.default_start

    @abstractmethod
    def stream(self, start: Start) -> ReasoningStream: ...

    @abstractmethod
    def thinking_format(self, start: Start, budget: int | None) -> dict[str, Any] | None:
        """The structural-tag format of the thinking (None: the output starts in the answer)."""

    def grammar(self, answer: GrammarSpec | None, start: Start, budget: int | None = None) -> GrammarSpec | None:
        """``answer`` applied after the thinking (None and no budget: no constraint)."""
        if answer is None and budget is None:
            return None
        think = self.thinking_format(start, budget)
        if think is None:
            return answer
        rest = answer_format(answer)
        fmt = think if rest is None else {"type": "sequence", "elements": [think, rest]}
        return GrammarSpec("structural_tag", json.dumps({"type": "structural_tag", "format": fmt}))


def answer_format(spec: GrammarSpec | None) -> dict[str, Any] | None:
    """A constraint as a structural-tag format (None: any text)."""
    if spec is None:
        return {"type": "any_text"}
    if spec.kind == "json":
        if not spec.value:  # any JSON object: not strict (the engine reads "strict")
            return {"type": "json_schema", "json_schema": {"type": "object"}, "strict": False}
        return {"type": "json_schema", "json_schema": json.loads(spec.value)}
    if spec.kind == "regex":
        return {"type": "regex", "pattern": spec.value}
    if spec.kind == "ebnf":
        return {"type": "grammar", "grammar": spec.value}
    if spec.kind == "choice":
        choices = json.loads(spec.value)
        return {"type": "or", "elements": [{"type": "const_string", "value": c} for c in choices]}
    fmt = json.loads(spec.value)["format"]
    assert isinstance(fmt, dict)
    return fmt


# ---------------------------------------------------------------------- <think>…</think>
def _held(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class _ThinkStream(ReasoningStream):
    """States: ``maybe`` (leading whitespace and a possible ``<think>`` held back), ``open`` (in
    the thinking; a leading ``<think>`` is dropped), ``thinking`` (a possible ``</think>`` held
    back), ``gap`` (whitespace after ``</think>`` dropped), ``answer`` (passed on as it comes)."""

    def __init__(self, start: Start, open_: str, close: str) -> None:
        self.state = {"thinking": "open", "maybe": "maybe", "answer": "answer"}[start]
        self.open, self.close = open_, close
        self.buf = ""

    def feed(self, text: str) -> Split:
        self.buf += text
        out = Split()
        while True:
            piece, more = self._step()
            out = out + piece
            if not more:
                return out

    def _step(self) -> tuple[Split, bool]:
        s, buf = self.state, self.buf
        if s == "maybe" or s == "open":
            head = buf.lstrip()
            if head.startswith(self.open):
                self.buf, self.state = head[len(self.open):], "thinking"
                return Split(), True
            if self.open.startswith(head):  # (all whitespace, or the start of the marker): wait
                return Split(), False
            self.state = "answer" if s == "maybe" else "thinking"
            return Split(), True
        if s == "thinking":
            i = buf.find(self.close)
            if i >= 0:
                self.buf, self.state = buf[i + len(self.close):], "gap"
                return Split(reasoning=buf[:i]), True
            keep = _held(buf, self.close)
            self.buf = buf[len(buf) - keep:]
            return Split(reasoning=buf[: len(buf) - keep]), False
        if s == "gap":
            self.buf = buf.lstrip()
            if not self.buf:
                return Split(), False
            self.state = "answer"
            return Split(), True
        self.buf = ""
        return Split(content=buf), False

    def finish(self) -> Split:
        buf, self.buf = self.buf, ""
        if self.state == "maybe":
            return Split(content=buf)
        if self.state in ("open", "thinking"):
            return Split(reasoning=buf.lstrip() if self.state == "open" else buf)
        if self.state == "answer":
            return Split(content=buf)
        return Split()


class ThinkParser(ReasoningParser):
    """``<think>…</think>`` then the answer (whitespace between them dropped)."""

    open = "<think>"
    close = "</think>"
    GAP = "\n\n"  # what the models write between the thinking and the answer (allowed, not required)

    def stream(self, start: Start) -> ReasoningStream:
        return _ThinkStream(start, self.open, self.close)

    def thinking_format(self, start: Start, budget: int | None) -> dict[str, Any] | None:
        if start == "answer":
            return None
        text: dict[str, Any] = {"type": "any_text"}
        if budget is not None:
            text["max_tokens"] = budget
        ends = [self.close + self.GAP[:k] for k in range(len(self.GAP) + 1)]
        if start == "thinking":
            return {"type": "tag", "begin": "", "content": text, "end": ends}
        return {"type": "optional", "content": {"type": "tag", "begin": self.open, "content": text, "end": ends}}


class DeepSeekR1Parser(ThinkParser):
    """DeepSeek-R1 and its distills: the template opens ``<think>`` in the prompt (older ones let
    the model write it), so the output is thinking until ``</think>``."""

    name = "deepseek_r1"
    default_start = "thinking"


class Qwen3Parser(ThinkParser):
    """Qwen3: a ``<think>`` block first when the model thinks (``enable_thinking=False`` renders
    an empty one into the prompt: then the output is all answer)."""

    name = "qwen3"
    default_start = "maybe"


# ---------------------------------------------------------------------- harmony (gpt-oss)
_MARKER = re.compile(r"<\|(start|channel|message|end|return|call|constrain)\|>")
_PARTIAL = re.compile(r"<(\|([a-z]{0,9}\|?)?)?$")


class _HarmonyStream(ReasoningStream):
    """Harmony messages as text: ``<|channel|>NAME … <|message|>BODY<|end|>``; the ``analysis``
    channel's bodies are the thinking, every other body (``final``, text outside any message) the
    answer; headers and markers are dropped."""

    def __init__(self) -> None:
        self.buf = ""
        self.mode = "body"  # body | header
        self.channel = "final"
        self.header = ""

    def feed(self, text: str) -> Split:
        self.buf += text
        out = Split()
        while True:
            m = _MARKER.search(self.buf)
            if m is None:
                part = _PARTIAL.search(self.buf)  # the start of a marker: wait for the rest
                keep = len(self.buf) - part.start() if part is not None else 0
                out = out + self._text(self.buf[: len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep:]
                return out
            out = out + self._text(self.buf[: m.start()])
            self.buf = self.buf[m.end():]
            self._marker(m.group(1))

    def _text(self, text: str) -> Split:
        if not text:
            return Split()
        if self.mode == "header":
            self.header += text
            return Split()
        return Split(reasoning=text) if self.channel == "analysis" else Split(content=text)

    def _marker(self, name: str) -> None:
        if name in ("start", "channel"):
            self.mode, self.header = "header", ""
        elif name == "message":
            words = self.header.split()
            self.channel = words[0] if words else "final"
            self.mode = "body"
        elif name == "constrain":
            pass
        else:  # end, return, call: the message is over
            self.mode, self.channel, self.header = "header", "final", ""

    def finish(self) -> Split:
        buf, self.buf = self.buf, ""
        return self._text(buf)


class GptOssParser(ReasoningParser):
    """gpt-oss (harmony): the ``analysis`` channel is the thinking, ``final`` the answer."""

    name = "gpt_oss"
    open = "<|channel|>analysis<|message|>"
    close = "<|end|>"
    default_start = "maybe"
    special_tokens = True

    def start(self, prompt_text: str) -> Start:
        return "maybe"

    def stream(self, start: Start) -> ReasoningStream:
        return _HarmonyStream()

    def thinking_format(self, start: Start, budget: int | None) -> dict[str, Any] | None:
        # NOTE: harmony's markers are special tokens, which XGrammar never matches as text: they
        # are named as tokens (the tokenizer must have them: a gpt-oss tokenizer does).
        def tok(t: str) -> dict[str, Any]:
            return {"type": "token", "token": t}

        def text(t: str) -> dict[str, Any]:
            return {"type": "const_string", "value": t}

        body: dict[str, Any] = {"type": "any_tokens", "exclude_tokens": ["<|end|>", "<|start|>", "<|channel|>"]}
        if budget is not None:
            body["max_tokens"] = budget
        analysis = {"type": "sequence", "elements": [
            tok("<|channel|>"), text("analysis"), tok("<|message|>"),
            {"type": "tag", "begin": "", "content": body, "end": tok("<|end|>")}]}
        final = {"type": "sequence", "elements": [
            tok("<|start|>"), text("assistant"), tok("<|channel|>"), text("final"), tok("<|message|>")]}
        return {"type": "sequence", "elements": [{"type": "optional", "content": analysis}, final]}


PARSERS: dict[str, type[ReasoningParser]] = {p.name: p for p in (DeepSeekR1Parser, Qwen3Parser, GptOssParser)}
assert set(REASONING_PARSERS) == {"auto", "none", *PARSERS}, "the config's names are the parsers' names"


def choose_parser(name: str, template: str, architecture: str | None) -> ReasoningParser | None:
    """``--reasoning-parser``: a parser by name, ``none``, or ``auto`` (from the model's
    architecture and chat template: harmony → gpt_oss, DeepSeek's template markers with
    ``<think>`` → deepseek_r1, another template with ``<think>`` → qwen3; otherwise none)."""
    if name == "none":
        return None
    if name != "auto":
        if name not in PARSERS:
            raise ValueError(f"unknown reasoning parser {name!r}; choose one of {', '.join(REASONING_PARSERS)}")
        return PARSERS[name]()
    if architecture == "GptOssForCausalLM" or "<|channel|>" in template:
        return GptOssParser()
    if "</think>" in template or "<think>" in template:
        if "<｜Assistant｜>" in template:
            return DeepSeekR1Parser()
        return Qwen3Parser()
    return None


@dataclass(frozen=True, slots=True)
class Thinking:
    """One request's reasoning: its model's parser and where its output starts."""

    parser: ReasoningParser
    start: Start

    def grammar(self, answer: GrammarSpec | None, budget: int | None) -> GrammarSpec | None:
        return self.parser.grammar(answer, self.start, budget)

    def stream(self) -> ReasoningStream:
        return self.parser.stream(self.start)

    def split(self, text: str) -> Split:
        """A whole answer at once (the same splitter as streaming, fed in one go)."""
        s = self.stream()
        return s.feed(text) + s.finish()
