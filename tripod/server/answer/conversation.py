"""A conversation, whichever API it came through, rendered into prompt token ids.

Both APIs turn their messages into ``Message``s (OpenAI's ``tool_calls`` / ``tool`` messages,
Anthropic's ``tool_use`` / ``tool_result`` blocks), and ``ChatRenderer`` renders them with the
model's chat template. Tools reach the template as it expects them when the template renders
tools in the parser's own syntax (e.g. Qwen's ``<tool_call>``); otherwise (the embedded SmolLM2's
template has no tools) in the parser's generic prompt format: the tool list appended to the system
message, earlier calls written as the model would write them, results as user messages.

Images: a message that holds images keeps its content in order in ``Message.parts`` (text and
``ImageRef``s). A vision-language model's template is given every message's content as a list of
parts (``{"type": "text", ...}``, ``{"type": "image"}``), the shape those templates are written
for (LLaVA's renders nothing of a plain string), so it writes one image placeholder per image;
``server/media/prompt.py`` then has the processor expand each placeholder into the image's tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from tripod.server.answer.text import ChatTemplateError, TextSide
from tripod.server.answer.tools import PARSERS, ToolCallParser, ToolSpec
from tripod.server.errors import APIError
from tripod.server.media.sources import ImageRef


@dataclass(frozen=True, slots=True)
class PastCall:
    """A tool call the assistant made earlier in the conversation."""

    id: str
    name: str
    arguments: str  # JSON text


@dataclass(slots=True)
class Message:
    role: str  # system | user | assistant | tool
    content: str
    tool_calls: list[PastCall] = field(default_factory=list)
    tool_call_id: str | None = None  # role "tool": the call this answers
    name: str | None = None
    # A message with images: its content in order, text and images (``content`` is its text alone).
    parts: list[str | ImageRef] | None = None

    @classmethod
    def of_parts(cls, role: str, parts: list[str | ImageRef], name: str | None = None) -> Message:
        """A message from its content parts (``parts`` kept only when one is an image)."""
        text = "".join(p for p in parts if isinstance(p, str))
        return cls(role, text, name=name, parts=parts if any(isinstance(p, ImageRef) for p in parts) else None)

    @property
    def images(self) -> list[ImageRef]:
        return [p for p in self.parts or () if isinstance(p, ImageRef)]


class ChatRenderer:
    """Owns how conversations and tools become prompts for one model (and says how, for
    ``/v1/models``)."""

    def __init__(self, text: TextSide, parser: str = "hermes", *, parts: bool = False) -> None:
        """``parts``: the template takes content as a list of parts (a vision-language model's)."""
        self.text = text
        self.parts = parts
        self.parser: ToolCallParser = PARSERS[parser]()
        template = text.template
        # NOTE: the template's own tool rendering is used only when it writes calls in the
        # syntax our parser reads back; otherwise the model would be shown one syntax and parsed
        # with another.
        self.native_tools = "tools" in template and self.parser.trigger in template
        # NOTE: a model shown tools only through the generic prompt was never trained to stop
        # after its calls: given the choice, a small one calls again and again until max_tokens,
        # leaving a cut call. So in the generic format one call per answer is the default, and
        # parallel calls are made only when asked for (parallel_tool_calls: true).
        self.parallel_default = self.native_tools

    def describe(self) -> dict[str, Any]:
        return {
            "parser": self.parser.name,
            "prompt_format": "chat_template" if self.native_tools else "generic",
            "trigger": self.parser.trigger,
            "parallel_calls_by_default": self.parallel_default,
        }

    def render(self, messages: list[Message], tools: list[ToolSpec] | None = None, *,
               continue_final: bool = False, param: str = "messages") -> list[int]:
        if self.native_tools:
            dicts, template_tools = self._native(messages), [t.openai() for t in tools or []]
        else:
            dicts, template_tools = self._generic(messages, tools or []), []
        for d in dicts:
            d["content"] = self._content(d["content"])
        try:
            return self.text.chat(dicts, tools=template_tools or None, continue_final=continue_final)
        except ChatTemplateError as e:
            raise APIError(400, str(e), param=param) from None

    def _content(self, content: str | list[str | ImageRef]) -> Any:
        """A message's content as the template takes it: a string, or (``parts``) a list of parts."""
        if not self.parts:
            return content if isinstance(content, str) else "".join(p for p in content if isinstance(p, str))
        items = [content] if isinstance(content, str) else content
        return [{"type": "text", "text": p} if isinstance(p, str) else {"type": "image"} for p in items if p != ""] \
            or [{"type": "text", "text": ""}]

    def _native(self, messages: list[Message]) -> list[dict[str, Any]]:
        out = []
        for m in messages:
            d: dict[str, Any] = {"role": m.role, "content": m.parts or m.content}
            if m.tool_calls:
                d["tool_calls"] = [{"id": c.id, "type": "function",
                                    "function": {"name": c.name, "arguments": _args_obj(c.arguments)}}
                                   for c in m.tool_calls]
            if m.tool_call_id is not None:
                d["tool_call_id"] = m.tool_call_id
            if m.name is not None:
                d["name"] = m.name
            out.append(d)
        return out

    def _generic(self, messages: list[Message], tools: list[ToolSpec]) -> list[dict[str, Any]]:
        p = self.parser
        out: list[dict[str, Any]] = []
        results: list[str] = []

        def flush_results() -> None:
            if results:
                out.append({"role": "user", "content": p.render_results(results)})
                results.clear()

        for m in messages:
            if m.role == "tool":
                results.append(m.content)
                continue
            flush_results()
            content = m.content
            if m.tool_calls:
                calls = p.render_calls([(c.name, c.arguments) for c in m.tool_calls])
                content = f"{content}\n{calls}" if content else calls
            # (a message with images has no calls: images come in user messages only)
            d: dict[str, Any] = {"role": m.role, "content": m.parts or content}
            if m.name is not None:
                d["name"] = m.name
            out.append(d)
        flush_results()
        if tools:
            extra = p.system_prompt(tools)
            if out and out[0]["role"] == "system":
                out[0]["content"] = f"{out[0]['content']}\n\n{extra}" if out[0]["content"] else extra
            else:
                out.insert(0, {"role": "system", "content": extra})
        return out


def _args_obj(arguments: str) -> Any:
    """Templates expect a call's arguments as an object (they serialise it themselves)."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments
