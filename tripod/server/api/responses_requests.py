"""The Responses surface's request model and its translations (the routes are ``responses.py``'s).

``input`` is a string or a list of items: messages (text parts; ``input_image`` parts in user
messages, whose ``image_url`` is a data: or http(s) URL: ``file_id`` needs the Files API, which
tripod does not have), ``function_call``,
``function_call_output`` and ``reasoning`` items, as OpenAI's API takes them. Items are checked
here one by one (``normal_items``: each gets its type and an id, errors name ``input[i].field``),
stored as checked, and a conversation of items (the stored turns before this one, then this one's)
becomes ``Message``s for the chat template (``to_messages``), exactly as the same conversation
sent to ``/v1/chat/completions`` would: an assistant's text and the calls after it are one
assistant message, each output a ``tool`` message. Reasoning items are kept in the conversation
but not shown to the template (chat messages carry no earlier thinking either).
"""

from __future__ import annotations

import json
from typing import Any

from tripod.protocol.sampling import GrammarSpec
from tripod.server.answer.conversation import Message, PastCall
from tripod.server.answer.generation import new_id
from tripod.server.answer.tools import ToolChoice, ToolSpec, check_choice, check_tools
from tripod.server.api.body import StrictModel
from tripod.server.errors import APIError
from tripod.server.media.sources import ImageRef, check_detail, check_url

INPUT_ROLES = ("user", "system", "developer", "assistant")
LOGPROBS_INCLUDE = "message.output_text.logprobs"
KNOWN_INCLUDES = (LOGPROBS_INCLUDE, "reasoning.encrypted_content")


class ResponsesRequest(StrictModel):
    """``POST /v1/responses`` (OpenAI's fields, and tripod's sampling extras as on chat)."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    include: list[str] | None = None
    truncation: str | None = None
    store: bool = True
    stream: bool = False
    background: bool = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    # tripod's extras, named as on chat
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    priority: int = 0
    ignore_eos: bool = False


def _bad(param: str, msg: str) -> APIError:
    return APIError(400, msg, param=param)


def _text_of(content: Any, where: str, allowed: tuple[str, ...]) -> str:
    """A message's content (a string or text parts) as one string."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where}.content", f"'{where}.content' must be a string or a list of content parts")
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_image":
            raise _bad(f"{where}.content[{j}]", f"'{where}.content[{j}]': images go in user messages only")
        if kind not in allowed or not isinstance(part.get("text"), str):
            raise _bad(f"{where}.content[{j}]", f"'{where}.content[{j}]' must be a text part "
                       f"({' or '.join(allowed)} with 'text'); tripod reads text only (got {kind!r})")
        out.append(part["text"])
    return "".join(out)


def _user_parts(content: Any, where: str) -> list[dict[str, Any]]:
    """A user message's content in normal form: one ``input_text`` part, or (with images) its
    ``input_text`` and ``input_image`` parts in order."""
    if not isinstance(content, list) or not any(isinstance(p, dict) and p.get("type") == "input_image" for p in content):
        return [{"type": "input_text", "text": _text_of(content, where, ("input_text", "text"))}]
    out: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "text") and isinstance(part.get("text"), str):
            out.append({"type": "input_text", "text": part["text"]})
            continue
        if kind != "input_image":
            raise _bad(at, f"'{at}' must be an input_text part (with 'text') or an input_image part (got {kind!r})")
        if part.get("file_id") is not None:
            raise _bad(f"{at}.file_id", f"'{at}.file_id': images by file_id need the Files API, which tripod does not "
                       "have; send 'image_url' (a data: URL or an http(s) URL)")
        url = part.get("image_url")
        if not isinstance(url, str):
            raise _bad(f"{at}.image_url", f"'{at}.image_url' is required: a data: URL (data:image/png;base64,...) or "
                       "an http(s) URL")
        check_url(url, f"{at}.image_url")
        out.append({"type": "input_image", "image_url": url,
                    "detail": check_detail(part.get("detail"), f"{at}.detail") or "auto"})
    return out


def _string(item: dict[str, Any], key: str, where: str) -> str:
    v = item.get(key)
    if not isinstance(v, str) or (key != "arguments" and not v):
        raise _bad(f"{where}.{key}", f"'{where}.{key}' is required and must be a non-empty string")
    return v


def normal_items(raw: str | list[dict[str, Any]], param: str = "input") -> list[dict[str, Any]]:
    """``input`` → checked items in one normal form (each with ``type`` and ``id``)."""
    if isinstance(raw, str):
        return [{"id": new_id("msg", "_"), "type": "message", "role": "user",
                 "content": [{"type": "input_text", "text": raw}]}]
    if not raw:
        raise _bad(param, f"'{param}' must hold at least one item")
    out = []
    for i, item in enumerate(raw):
        out.append(_normal_item(item, f"{param}[{i}]"))
    return out


def _normal_item(item: dict[str, Any], where: str) -> dict[str, Any]:
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
        role = item.get("role")
        if role not in INPUT_ROLES:
            raise _bad(f"{where}.role", f"'{where}.role' must be one of {', '.join(INPUT_ROLES)} (got {role!r})")
        if role == "user":
            content = _user_parts(item.get("content"), where)
        else:
            parts = ("output_text", "refusal") if role == "assistant" else ("input_text",)
            text = _text_of(item.get("content"), where, (*parts, "text"))
            part = "output_text" if role == "assistant" else "input_text"
            body: dict[str, Any] = {"type": part, "text": text}
            if part == "output_text":
                body["annotations"] = []
            content = [body]
        return {"id": item.get("id") or new_id("msg", "_"), "type": "message", "role": role,
                "status": "completed", "content": content}
    if kind == "function_call":
        args = _string(item, "arguments", where)
        return {"id": item.get("id") or new_id("fc", "_"), "type": "function_call", "status": "completed",
                "call_id": _string(item, "call_id", where), "name": _string(item, "name", where), "arguments": args}
    if kind == "function_call_output":
        out = item.get("output")
        text = out if isinstance(out, str) else _text_of(out, where, ("input_text", "output_text", "text"))
        return {"id": item.get("id") or new_id("fco", "_"), "type": "function_call_output", "status": "completed",
                "call_id": _string(item, "call_id", where), "output": text}
    if kind == "reasoning":
        content = item.get("content") or []
        summary = item.get("summary") or []
        for key, val in (("content", content), ("summary", summary)):
            if not isinstance(val, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in val):
                raise _bad(f"{where}.{key}", f"'{where}.{key}' must be a list of text parts")
        return {"id": item.get("id") or new_id("rs", "_"), "type": "reasoning", "summary": summary,
                "content": content}
    raise _bad(f"{where}.type", f"'{where}.type' {kind!r} is not supported; send 'message', 'function_call', "
               "'function_call_output' or 'reasoning' items")


def to_messages(items: list[dict[str, Any]], instructions: str | None, first_new: int) -> list[Message]:
    """A conversation of normal items → ``Message``s (``instructions`` first, as a system message).
    A ``function_call_output`` must answer a call earlier in the conversation; ``first_new`` is the
    index of this request's first item (errors name it as ``input[i]``)."""
    out: list[Message] = [Message("system", instructions)] if instructions else []
    calls: set[str] = set()
    for k, it in enumerate(items):
        kind = it["type"]
        if kind == "message":
            role = "system" if it["role"] == "developer" else it["role"]
            where = f"input[{k - first_new}]" if k >= first_new else f"previous_response_id (item {k})"
            out.append(Message.of_parts(role, [_part(p, f"{where}.content[{j}]") for j, p in enumerate(it["content"])]))
        elif kind == "function_call":
            calls.add(it["call_id"])
            call = PastCall(it["call_id"], it["name"], it["arguments"])
            last = out[-1] if out else None
            if last is not None and last.role == "assistant" and (not last.tool_calls or _merging(items, k)):
                last.tool_calls.append(call)
            else:
                out.append(Message("assistant", "", [call]))
        elif kind == "function_call_output":
            if it["call_id"] not in calls:
                where = f"input[{k - first_new}].call_id" if k >= first_new else "previous_response_id"
                raise _bad(where, f"'{where}': no function_call with call_id {it['call_id']!r} comes before "
                           "this output; send the call (or its previous_response_id) first")
            out.append(Message("tool", it["output"], tool_call_id=it["call_id"]))
    return out


def _part(part: dict[str, Any], where: str) -> str | ImageRef:
    """A normal content part: its text, or its image (``where`` names it in errors)."""
    if part["type"] == "input_image":
        return ImageRef(f"{where}.image_url", url=part["image_url"], detail=part.get("detail"))
    return str(part["text"])


def _merging(items: list[dict[str, Any]], k: int) -> bool:
    """Whether the call at ``k`` follows another call (parallel calls: one assistant message)."""
    j = k - 1
    while j >= 0 and items[j]["type"] == "reasoning":
        j -= 1
    return j >= 0 and items[j]["type"] == "function_call"


def responses_tools(req: ResponsesRequest, default_parallel: bool) -> tuple[list[ToolSpec], ToolChoice, list[dict[str, Any]]]:
    """``tools`` / ``tool_choice`` / ``parallel_tool_calls`` → checked tools, the choice, and the
    tools as the answer echoes them."""
    raw, echoed = [], []
    for i, t in enumerate(req.tools or []):
        if t.get("type") != "function":
            raise _bad(f"tools[{i}].type", f"'tools[{i}].type' {t.get('type')!r} is not supported; tripod runs "
                       "function tools only (the caller runs them)")
        name = t.get("name")
        if not isinstance(name, str):
            raise _bad(f"tools[{i}].name", f"'tools[{i}].name' is required")
        params = t.get("parameters")
        raw.append((name, t.get("description"), params))
        echoed.append({"type": "function", "name": name, "description": t.get("description"),
                       "parameters": params, "strict": t.get("strict", True)})
    tools = check_tools(raw, "tools")
    parallel = default_parallel if req.parallel_tool_calls is None else req.parallel_tool_calls
    tc = req.tool_choice
    if tc is None or tc == "auto":
        choice = ToolChoice("auto" if tools else "none", parallel=parallel)
    elif tc in ("none", "required"):
        choice = ToolChoice(tc, parallel=parallel)  # type: ignore[arg-type]
    elif isinstance(tc, dict) and tc.get("type") == "function" and isinstance(tc.get("name"), str):
        choice = ToolChoice("named", tc["name"], parallel=False)
    else:
        raise _bad("tool_choice", "'tool_choice' must be 'auto', 'none', 'required' or "
                   f"{{\"type\": \"function\", \"name\": ...}} (got {tc!r})")
    return tools, check_choice(choice, tools, "tool_choice"), echoed


def text_grammar(req: ResponsesRequest) -> tuple[GrammarSpec | None, dict[str, Any]]:
    """``text.format`` → the output constraint, and the ``text`` object the answer echoes."""
    fmt = (req.text or {}).get("format") or {"type": "text"}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    echo = {"format": fmt, **({"verbosity": req.text["verbosity"]} if req.text and "verbosity" in req.text else {})}
    if kind == "text":
        return None, echo
    if kind == "json_object":
        return GrammarSpec("json", ""), echo
    if kind == "json_schema":
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise _bad("text.format.schema", "'text.format.schema' must be a JSON schema object")
        if not isinstance(fmt.get("name"), str):
            raise _bad("text.format.name", "'text.format.name' is required for a json_schema format")
        return GrammarSpec("json", json.dumps(schema)), echo
    raise _bad("text.format.type", f"'text.format.type' must be 'text', 'json_object' or 'json_schema' (got {kind!r})")


def check_request(req: ResponsesRequest) -> bool:
    """Cross-field checks; returns whether output-text logprobs were asked for."""
    for i, inc in enumerate(req.include or []):
        if inc not in KNOWN_INCLUDES:
            raise _bad(f"include[{i}]", f"'include[{i}]' {inc!r} is not supported; tripod includes "
                       f"{', '.join(KNOWN_INCLUDES)}")
    if req.truncation not in (None, "auto", "disabled"):
        raise _bad("truncation", f"'truncation' must be 'auto' or 'disabled' (got {req.truncation!r})")
    if req.background and not req.store:
        raise _bad("background", "'background': true needs 'store': true (the answer is fetched later)")
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
        raise _bad("top_logprobs", f"'top_logprobs' must be between 0 and 20 (got {req.top_logprobs})")
    if req.max_output_tokens is not None and req.max_output_tokens < 1:
        raise _bad("max_output_tokens", f"'max_output_tokens' must be >= 1 (got {req.max_output_tokens})")
    return LOGPROBS_INCLUDE in (req.include or [])
