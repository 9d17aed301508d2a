"""The Anthropic surface's request models (strict pydantic on ``body.StrictModel``, like the
OpenAI side) and their translation into ``Message``s, tools and a tool choice. The routes are
``anthropic.py``'s.

Content blocks are read as one permissive model and checked by type here, so an unsupported block
(``document``) is refused by name with a 400 rather than a schema dump. ``image`` blocks (base64 or
url sources) in user messages become ``ImageRef``s (``server/media``). Earlier
``thinking`` blocks in assistant messages are accepted and left out of the prompt (as Anthropic
does: past thinking does not count as input).
``cache_control`` marks are accepted and ignored: tripod's prefix cache needs no hints.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import Field

from tripod.protocol.sampling import GrammarSpec
from tripod.server.answer.conversation import Message, PastCall
from tripod.server.answer.tools import ToolChoice, ToolSpec, check_choice, check_tools
from tripod.server.api.body import StrictModel, one_of
from tripod.server.errors import APIError
from tripod.server.media.sources import ImageRef, check_url

TEMPERATURE_MAX = 1.0  # Anthropic's range is [0, 1] (tripod's sampler allows up to 2)


class ImageSource(StrictModel):
    type: str = one_of("base64", "url")
    media_type: str | None = None  # base64: image/jpeg, image/png, image/gif or image/webp (the bytes are sniffed)
    data: str | None = None  # base64
    url: str | None = None  # url


class Block(StrictModel):
    type: str = one_of("text", "image", "tool_use", "tool_result", "thinking", "redacted_thinking")
    text: str | None = None
    id: str | None = None  # tool_use
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None  # tool_result
    content: str | list[Block] | None = None
    is_error: bool | None = None
    source: ImageSource | None = None  # image


class AnthropicMessage(StrictModel):
    role: str = one_of("user", "assistant")
    content: str | list[Block]


class AnthropicTool(StrictModel):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None  # "custom" or absent; Anthropic's server tools name a version here


class AnthropicToolChoice(StrictModel):
    type: str = one_of("auto", "any", "tool", "none")
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class _Conversation(StrictModel):
    model: str
    messages: list[AnthropicMessage]
    system: str | list[Block] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: dict[str, Any] | None = None


class OutputFormat(StrictModel):
    type: str
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")


class OutputConfig(StrictModel):
    format: OutputFormat | None = None


class MessagesRequest(_Conversation):
    max_tokens: int
    output_config: OutputConfig | None = None  # Anthropic's structured outputs (format: json_schema)
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None
    stream: bool = False
    # tripod's extensions, as on the OpenAI side.
    seed: int | None = None
    ignore_eos: bool = False
    priority: int = 0
    speculative: bool = True  # false: no speculative decoding for this request


class CountTokensRequest(_Conversation):
    pass


def _text_of(blocks: str | list[Block] | None, where: str) -> str:
    if blocks is None:
        return ""
    if isinstance(blocks, str):
        return blocks
    parts = []
    for j, b in enumerate(blocks):
        if b.type == "image":
            raise APIError(400, f"{where}.{j}: tripod takes images in user messages' content only, not here; move "
                           "the image into a user message (beside the tool_result)", param=f"{where}.{j}.type")
        if b.type != "text" or b.text is None:
            raise APIError(400, f"{where}.{j}: content blocks of type {b.type!r} are not supported here; "
                           "send text blocks", param=f"{where}.{j}.type")
        parts.append(b.text)
    return "".join(parts)


def conversation(req: _Conversation, default_parallel: bool = True,
                 ) -> tuple[list[Message], list[ToolSpec], ToolChoice, bool]:
    """→ (messages, tools, tool choice, whether the last assistant message is to be continued).
    ``default_parallel``: whether several calls are allowed unless ``disable_parallel_tool_use``
    says."""
    out: list[Message] = []
    system = _text_of(req.system, "system")
    if system:
        out.append(Message("system", system))
    if not req.messages:
        raise APIError(400, "'messages' must hold at least one message", param="messages")
    for i, m in enumerate(req.messages):
        where = f"messages.{i}"
        if m.role not in ("user", "assistant"):
            raise APIError(400, f"{where}.role must be 'user' or 'assistant' (got {m.role!r}); put system text in "
                           "the top-level 'system'", param=f"{where}.role")
        if isinstance(m.content, str):
            out.append(Message(m.role, m.content))
            continue
        parts: list[str | ImageRef] = []
        calls: list[PastCall] = []
        for j, b in enumerate(m.content):
            at = f"{where}.content.{j}"
            if b.type == "text":
                if b.text is None:
                    raise APIError(400, f"{at}.text is required", param=f"{at}.text")
                parts.append(b.text)
            elif b.type == "image" and m.role == "user":
                parts.append(anthropic_image(b, at))
            elif b.type == "tool_use" and m.role == "assistant":
                if not b.id or not b.name:
                    raise APIError(400, f"{at}: a tool_use block needs 'id' and 'name'", param=at)
                calls.append(PastCall(b.id, b.name, json.dumps(b.input or {}, ensure_ascii=False)))
            elif b.type == "tool_result" and m.role == "user":
                if not b.tool_use_id:
                    raise APIError(400, f"{at}: a tool_result block needs 'tool_use_id'", param=at)
                if parts:  # text (and images) before a result: keep the order
                    out.append(Message.of_parts("user", parts))
                    parts = []
                content = _text_of(b.content, f"{at}.content")
                out.append(Message("tool", f"Error: {content}" if b.is_error else content,
                                   tool_call_id=b.tool_use_id))
            elif b.type in ("thinking", "redacted_thinking") and m.role == "assistant":
                continue  # past thinking is not part of the prompt
            elif b.type in ("tool_use", "tool_result", "image"):
                raise APIError(400, f"{at}: {b.type} blocks belong in "
                               f"{'assistant' if b.type == 'tool_use' else 'user'} messages", param=f"{at}.type")
            else:
                raise APIError(400, f"{at}: content blocks of type {b.type!r} are not supported by tripod; send "
                               "text, image, tool_use and tool_result blocks", param=f"{at}.type")
        if parts or calls or not m.content:
            msg = Message.of_parts(m.role, parts)
            msg.tool_calls = calls
            out.append(msg)
    if all(m.role == "system" for m in out):
        raise APIError(400, "'messages' hold nothing to prompt with: past thinking blocks are left out of the "
                       "prompt; add a user message", param="messages")
    # An assistant turn to continue: the last message, when it is the assistant's and kept (one of only
    # thinking blocks is left out: the model then answers anew after what came before).
    last = req.messages[-1]
    continue_final = last.role == "assistant" and out[-1].role == "assistant" and not out[-1].tool_calls
    tools, choice = _tools(req, default_parallel)
    return out, tools, choice, continue_final


def anthropic_image(b: Block, at: str) -> ImageRef:
    """An ``image`` block's image (not fetched: ``server/media`` loads it)."""
    src = b.source
    if src is None:
        raise APIError(400, f"{at}.source is required: {{\"type\": \"base64\", \"media_type\": \"image/png\", "
                       "\"data\": ...} or {\"type\": \"url\", \"url\": ...}", param=f"{at}.source")
    if src.type == "base64":
        if src.data is None:
            raise APIError(400, f"{at}.source.data is required (the image's bytes, base64)", param=f"{at}.source.data")
        if src.media_type is not None and not src.media_type.startswith("image/"):
            raise APIError(400, f"{at}.source.media_type must be an image type such as image/png (got "
                           f"{src.media_type!r})", param=f"{at}.source.media_type")
        return ImageRef(f"{at}.source.data", b64=src.data)
    if src.type == "url":
        if src.url is None:
            raise APIError(400, f"{at}.source.url is required", param=f"{at}.source.url")
        return ImageRef(f"{at}.source.url", url=check_url(src.url, f"{at}.source.url"))
    raise APIError(400, f"{at}.source.type {src.type!r} is not supported by tripod (file sources need the Files API, "
                   "which tripod does not have); send 'base64' or 'url'", param=f"{at}.source.type")


def thinking_budget(req: MessagesRequest) -> tuple[bool, int | None]:
    """``thinking``: (whether extended thinking is asked for, its ``budget_tokens``). Whether the
    model thinks is the model's: ``disabled`` (or no ``thinking``) still shows the thinking of a
    model that always thinks; ``enabled`` needs a model with a reasoning parser."""
    t = req.thinking
    kind = None if t is None else t.get("type")
    if kind in (None, "disabled"):
        return False, None
    if kind == "adaptive":
        return True, None
    if kind != "enabled":
        raise APIError(400, f"'thinking.type' must be 'enabled', 'adaptive' or 'disabled' (got {kind!r})",
                       param="thinking.type")
    budget = t.get("budget_tokens") if t is not None else None
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
        raise APIError(400, f"'thinking.budget_tokens' must be a positive integer (got {budget!r})",
                       param="thinking.budget_tokens")
    if budget >= req.max_tokens:
        raise APIError(400, f"'thinking.budget_tokens' ({budget}) must be less than 'max_tokens' ({req.max_tokens})",
                       param="thinking.budget_tokens")
    return True, budget


def output_format(req: MessagesRequest) -> GrammarSpec | None:
    """``output_config.format`` (a JSON schema the answer must match) as a grammar."""
    fmt = req.output_config.format if req.output_config else None
    if fmt is None:
        return None
    if fmt.type != "json_schema" or fmt.schema_ is None:
        raise APIError(400, "'output_config.format' must be {\"type\": \"json_schema\", \"schema\": {...}}",
                       param="output_config.format")
    return GrammarSpec("json", json.dumps(fmt.schema_))


def _tools(req: _Conversation, default_parallel: bool) -> tuple[list[ToolSpec], ToolChoice]:
    raw = []
    for i, t in enumerate(req.tools or []):
        if t.type not in (None, "custom"):
            raise APIError(400, f"tools.{i}: the server tool {t.type!r} is not supported by tripod; define "
                           "client tools (name, description, input_schema)", param=f"tools.{i}.type")
        if t.input_schema is None:
            raise APIError(400, f"tools.{i}.input_schema is required", param=f"tools.{i}.input_schema")
        raw.append((t.name, t.description, t.input_schema))
    tools = check_tools(raw, "tools")
    tc = req.tool_choice
    if tc is None or tc.disable_parallel_tool_use is None:
        parallel = default_parallel
    else:
        parallel = not tc.disable_parallel_tool_use
    if tc is None or tc.type == "auto":
        choice = ToolChoice("auto" if tools else "none", parallel=parallel)
    elif tc.type == "any":
        choice = ToolChoice("required", parallel=parallel)
    elif tc.type == "tool":
        if not tc.name:
            raise APIError(400, "'tool_choice.name' is required when its type is 'tool'", param="tool_choice.name")
        choice = ToolChoice("named", tc.name, parallel=False)
    elif tc.type == "none":
        choice = ToolChoice("none")
    else:
        raise APIError(400, f"'tool_choice.type' must be 'auto', 'any', 'tool' or 'none' (got {tc.type!r})",
                       param="tool_choice.type")
    return tools, check_choice(choice, tools, "tool_choice")
