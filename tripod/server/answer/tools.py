"""Tool calling, shared by the OpenAI and the Anthropic API: tool definitions, the caller's
choice, and the parsers of the model's tool-call syntax.

A ``ToolCallParser`` owns one syntax (Hermes-style ``<tool_call>{"name": ..., "arguments": ...}
</tool_call>`` first; others can be added to ``PARSERS``). It does three jobs:

- ``grammar``: the XGrammar structural tag that makes every call parse and its arguments match
  that tool's schema (``required`` / a named tool: calls only; ``auto``: free text until the
  trigger ``<tool_call>``, then the constrained call; ``none``: no constraint);
- the generic prompt format, for chat templates that know nothing of tools: the tool list in the
  system message, earlier calls written as the model writes them, results as user messages;
- ``stream``: an incremental parser turning the model's text into ``ToolEvent``s (text, call
  start with its name, argument pieces, call end), used for streamed and whole answers alike, so
  both always agree.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from tripod.protocol.sampling import GrammarSpec
from tripod.server.errors import APIError

NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
MAX_TOOLS = 128


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """One callable function: its name, what it does, the JSON schema of its arguments."""

    name: str
    description: str | None
    parameters: dict[str, Any]

    def openai(self) -> dict[str, Any]:
        fn: dict[str, Any] = {"name": self.name}
        if self.description:
            fn["description"] = self.description
        fn["parameters"] = self.parameters
        return {"type": "function", "function": fn}


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """``auto``: text or calls, the model decides; ``required``: at least one call; ``named``: one
    call of ``name``; ``none``: no call. ``parallel``: more than one call allowed."""

    mode: Literal["auto", "required", "named", "none"] = "auto"
    name: str | None = None
    parallel: bool = True


def check_tools(raw: list[tuple[str, str | None, Any]], param: str) -> list[ToolSpec]:
    """(name, description, parameters schema or None) per tool → checked ``ToolSpec``s."""
    if len(raw) > MAX_TOOLS:
        raise APIError(400, f"'{param}' may hold at most {MAX_TOOLS} tools (got {len(raw)})", param=param)
    out: list[ToolSpec] = []
    seen: set[str] = set()
    for i, (name, desc, params) in enumerate(raw):
        if not NAME_RE.match(name):
            raise APIError(400, f"{param}[{i}]: the tool name {name!r} must be 1-128 letters, digits, '_' or '-'",
                           param=f"{param}.{i}")
        if name in seen:
            raise APIError(400, f"{param}[{i}]: the tool name {name!r} is used twice", param=f"{param}.{i}")
        seen.add(name)
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise APIError(400, f"{param}[{i}]: the parameters of {name!r} must be a JSON schema object",
                           param=f"{param}.{i}")
        out.append(ToolSpec(name, desc, params))
    return out


def check_choice(choice: ToolChoice, tools: list[ToolSpec], param: str) -> ToolChoice:
    if choice.mode == "named" and choice.name not in {t.name for t in tools}:
        raise APIError(400, f"'{param}' names the tool {choice.name!r}, which is not among the tools given",
                       param=param)
    if choice.mode in ("required", "named") and not tools:
        raise APIError(400, f"'{param}' asks for a tool call but no tools were given", param=param)
    return choice


# ---------------------------------------------------------------------- events
@dataclass(frozen=True, slots=True)
class TextPiece:
    text: str


@dataclass(frozen=True, slots=True)
class CallStart:
    index: int  # the call's position among this answer's calls
    id: str
    name: str


@dataclass(frozen=True, slots=True)
class ArgsPiece:
    index: int
    text: str  # the next characters of the arguments' JSON text


@dataclass(frozen=True, slots=True)
class CallEnd:
    index: int
    complete: bool  # False: the answer ended inside the call (max_tokens)


ToolEvent = TextPiece | CallStart | ArgsPiece | CallEnd


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str = ""  # JSON text
    complete: bool = False


@dataclass(slots=True)
class ParsedAnswer:
    """A whole answer: its text (markup removed) and its calls, in order."""

    text: str = ""
    calls: list[ToolCall] = field(default_factory=list)

    def add(self, events: list[ToolEvent]) -> None:
        for e in events:
            if isinstance(e, TextPiece):
                self.text += e.text
            elif isinstance(e, CallStart):
                self.calls.append(ToolCall(e.id, e.name))
            elif isinstance(e, ArgsPiece):
                self.calls[e.index].arguments += e.text
            else:
                self.calls[e.index].complete = e.complete


class ToolCallStream(ABC):
    """Incremental parser of one answer: ``feed`` text as it comes, ``finish`` at the end."""

    @abstractmethod
    def feed(self, text: str) -> list[ToolEvent]: ...

    @abstractmethod
    def finish(self) -> list[ToolEvent]: ...


class ToolCallParser(ABC):
    """One tool-call syntax: its grammar, its generic prompt format and its parser."""

    name: ClassVar[str]
    trigger: ClassVar[str]  # the text that starts a call

    @abstractmethod
    def grammar(self, tools: list[ToolSpec], choice: ToolChoice) -> GrammarSpec | None: ...

    @abstractmethod
    def system_prompt(self, tools: list[ToolSpec]) -> str: ...

    @abstractmethod
    def render_calls(self, calls: list[tuple[str, str]]) -> str:
        """Earlier calls ((name, arguments JSON)) as the model writes them."""

    @abstractmethod
    def render_results(self, results: list[str]) -> str:
        """Tool results as one user message."""

    @abstractmethod
    def stream(self, new_id: Callable[[], str]) -> ToolCallStream: ...


# ---------------------------------------------------------------------- Hermes
class HermesParser(ToolCallParser):
    """``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``, one block per call,
    blocks separated by a newline (Hermes, Qwen 2.5/3 and most open models' templates)."""

    name = "hermes"
    trigger = "<tool_call>"
    END = "</tool_call>"

    def _tag(self, t: ToolSpec) -> dict[str, Any]:
        return {"type": "tag", "begin": f'{self.trigger}\n{{"name": {json.dumps(t.name)}, "arguments": ',
                "content": {"type": "json_schema", "json_schema": t.parameters},
                "end": f"}}\n{self.END}"}

    def grammar(self, tools: list[ToolSpec], choice: ToolChoice) -> GrammarSpec | None:
        if choice.mode == "none" or not tools:
            return None
        if choice.mode == "named":
            fmt: dict[str, Any] = self._tag(next(t for t in tools if t.name == choice.name))
        else:
            tags = [self._tag(t) for t in tools]
            one: dict[str, Any] = {"type": "or", "elements": tags} if len(tags) > 1 else tags[0]
            more = {"type": "star", "content": {"type": "sequence",
                                                "elements": [{"type": "const_string", "value": "\n"}, one]}}
            if choice.mode == "auto":
                # Free text until the trigger, then one call; more calls only right after it.
                fmt = {"type": "triggered_tags", "triggers": [self.trigger], "tags": tags, "stop_after_first": True}
                if choice.parallel:
                    fmt = {"type": "sequence", "elements": [fmt, more]}
            else:
                fmt = {"type": "sequence", "elements": [one, more]} if choice.parallel else one
        return GrammarSpec("structural_tag", json.dumps({"type": "structural_tag", "format": fmt}))

    def system_prompt(self, tools: list[ToolSpec]) -> str:
        lines = "\n".join(json.dumps(t.openai(), ensure_ascii=False) for t in tools)
        return (
            "You have functions (tools) you can call to help you answer. Each line between <tools> "
            "and </tools> describes one, with the JSON schema of its arguments:\n"
            f"<tools>\n{lines}\n</tools>\n"
            "To call one, write exactly this, once per call, and nothing after your calls:\n"
            f'{self.trigger}\n{{"name": "<the function\'s name>", "arguments": <its arguments as a JSON object>}}\n'
            f"{self.END}\n"
            "The results come back inside <tool_response></tool_response> tags."
        )

    def render_calls(self, calls: list[tuple[str, str]]) -> str:
        out = []
        for name, args in calls:
            try:  # the model writes compact JSON with ", " and ": " (the grammar's own layout)
                args = json.dumps(json.loads(args), ensure_ascii=False)
            except ValueError:
                pass
            out.append(f'{self.trigger}\n{{"name": {json.dumps(name)}, "arguments": {args}}}\n{self.END}')
        return "\n".join(out)

    def render_results(self, results: list[str]) -> str:
        return "\n".join(f"<tool_response>\n{r}\n</tool_response>" for r in results)

    def stream(self, new_id: Callable[[], str]) -> ToolCallStream:
        return _HermesStream(self.trigger, self.END, new_id)


_HEAD_START = '{"name": "'
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


class _HermesStream(ToolCallStream):
    """States: ``text`` (plain text; a possible start of the trigger, and trailing whitespace,
    held back), ``head`` (after the trigger, until the name is known), ``args`` (the arguments'
    JSON, passed on as it comes; a bracket/string scanner finds its end), ``tail`` (up to the
    closing tag). Whitespace around calls is dropped."""

    def __init__(self, start: str, end: str, new_id: Callable[[], str]) -> None:
        self.start, self.end, self.new_id = start, end, new_id
        self.state = "text"
        self.buf = ""
        self.calls = 0
        self.depth = 0
        self.in_str = False
        self.escaped = False
        self.begun = False  # the arguments' first character was seen
        self.scalar = False  # the arguments are a bare number/literal, not an object
        self.args_done = False
        self.after_call = False  # leading whitespace of the text after a call is dropped
        self.pre_ws = ""  # whitespace dropped before the trigger (restored if no call follows)

    def feed(self, text: str) -> list[ToolEvent]:
        self.buf += text
        out: list[ToolEvent] = []
        while self._step(out):
            pass
        return out

    def finish(self) -> list[ToolEvent]:
        out: list[ToolEvent] = []
        if self.state == "text":
            tail = self.buf.strip() if self.calls else self.buf
            if tail:
                out.append(TextPiece(tail))
        elif self.state == "head":
            # Cut before its name was complete: a call that never was (dropped), or, when what
            # follows the trigger cannot begin a call, text after all.
            head = self.buf.lstrip()
            if not _HEAD_START.startswith(head[: len(_HEAD_START)]):
                out.append(TextPiece(self.pre_ws + self.start + self.buf))
        else:
            out.append(CallEnd(self.calls - 1, self.state == "tail"))
        self.buf = ""
        self.state = "done"
        return out

    def _step(self, out: list[ToolEvent]) -> bool:
        """One move of the state machine over ``buf``; False when it needs more text."""
        if self.state == "text":
            return self._step_text(out)
        if self.state == "head":
            return self._step_head(out)
        if self.state == "args":
            n = self._scan(self.buf)
            if n:
                out.append(ArgsPiece(self.calls - 1, self.buf[:n]))
                self.buf = self.buf[n:]
            if self.args_done:
                self.state = "tail"
                return True
            return False
        if self.state == "tail":
            j = self.buf.find(self.end)
            if j < 0:
                return False
            out.append(CallEnd(self.calls - 1, True))
            self.buf = self.buf[j + len(self.end):]
            self.state = "text"
            self.after_call = True
            return True
        return False

    def _step_text(self, out: list[ToolEvent]) -> bool:
        if self.after_call:
            self.buf = self.buf.lstrip()
            if not self.buf:
                return False
            self.after_call = False
        i = self.buf.find(self.start)
        if i >= 0:
            before = self.buf[:i].rstrip()
            if before:
                out.append(TextPiece(before))
            self.pre_ws = self.buf[len(before):i]
            self.buf = self.buf[i + len(self.start):]
            self.state = "head"
            return True
        keep = len(self.buf) - len(self.buf.rstrip())
        body = self.buf[: len(self.buf) - keep]
        hold = _prefix_suffix(body, self.start)
        cut = len(body[: len(body) - hold].rstrip())
        if cut > 0:
            out.append(TextPiece(self.buf[:cut]))
            self.buf = self.buf[cut:]
        return False

    def _step_head(self, out: list[ToolEvent]) -> bool:
        m = _HEAD.match(self.buf)
        if m is not None and m.end() < len(self.buf):
            name = json.loads(f'"{m.group(1)}"')
            out.append(CallStart(self.calls, self.new_id(), name))
            self.calls += 1
            self.buf = self.buf[m.end():]
            self.state = "args"
            self.depth, self.in_str, self.escaped, self.begun, self.args_done = 0, False, False, False, False
            return True
        j = self.buf.find(self.end)
        if j >= 0:
            # Not our layout: parse the block whole.
            self.after_call = self._loose(self.buf[:j], out)
            self.buf = self.buf[j + len(self.end):]
            self.state = "text"
            return True
        return False

    def _scan(self, s: str) -> int:
        """How many characters of ``s`` belong to the arguments (all, unless they end in it;
        then ``args_done``)."""
        for i, ch in enumerate(s):
            if not self.begun:
                if ch.isspace():
                    continue
                self.begun = True
                self.scalar = ch not in '{["'
            if self.scalar:  # a bare number or literal ends before a delimiter
                if ch in ",}]" or ch.isspace():
                    self.args_done = True
                    return i
                continue
            if self.in_str:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_str = False
            elif ch == '"':
                self.in_str = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
            if self.depth <= 0 and not self.in_str:
                self.args_done = True
                return i + 1
        return len(s)

    def _loose(self, body: str, out: list[ToolEvent]) -> bool:
        """A call block in another layout; False when it is no call at all (kept as text)."""
        try:
            obj = json.loads(body)
            name, args = obj["name"], obj.get("arguments", obj.get("parameters", {}))
            if not isinstance(name, str):
                raise TypeError(name)
        except (ValueError, KeyError, TypeError):
            out.append(TextPiece(self.pre_ws + self.start + body + self.end))
            return False
        out.append(CallStart(self.calls, self.new_id(), name))
        out.append(ArgsPiece(self.calls, args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)))
        out.append(CallEnd(self.calls, True))
        self.calls += 1
        return True


def _prefix_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


PARSERS: dict[str, type[ToolCallParser]] = {"hermes": HermesParser}


def parse_all(parser: ToolCallParser, text: str, new_id: Callable[[], str]) -> ParsedAnswer:
    """A whole answer at once (the same parser as streaming, fed in one go)."""
    s = parser.stream(new_id)
    ans = ParsedAnswer()
    ans.add(s.feed(text))
    ans.add(s.finish())
    return ans
