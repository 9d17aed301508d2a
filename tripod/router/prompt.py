"""The text the router routes on: a request's prompt rendered the way a replica's prefix cache
would hold it, and its output budget.

The router holds no tokenizer and no chat template; it renders every message (role and content,
tool definitions, tool calls and results, in order) into one canonical text, the same for an
OpenAI chat and the Anthropic messages equivalent, so that a conversation's later turns match
the prefix its earlier turns left in a replica's tree (``router/prefix_tree.py``).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

DEFAULT_OUTPUT_TOKENS = 256  # output budget counted into load when a request names none
IMAGE_MARK = "<|image:"  # an image in the routed text: IMAGE_MARK + its fingerprint + "|>"
# The prompt tokens an image is estimated at (the replica's processor decides: LLaVA-1.5 576, Gemma 3
# 256, Qwen2.5-VL by resolution); what the router's load and prefill hand-over decisions count.
IMAGE_TOKENS = 256


def is_anthropic(path: str) -> bool:
    """Whether ``path`` is one of Anthropic's routes (its errors then take Anthropic's shape)."""
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def _args(value: Any) -> str:
    """A call's arguments in one canonical layout (OpenAI sends JSON text, Anthropic an object)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return value
    return json.dumps(value, sort_keys=True)


_TEXT_PARTS = ("text", "input_text", "output_text", "refusal")


def _text(content: Any) -> str:
    """A message's content as text: its text parts, and a mark for each image."""
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) if p.get("type", "text") in _TEXT_PARTS else _image_mark(p)
                       for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""


def _image_source(part: dict[str, Any]) -> str | None:
    """The URL or data of an image part (OpenAI's image_url, Anthropic's image, the Responses API's
    input_image); None for another part."""
    kind = part.get("type")
    src: Any = None
    if kind == "image_url":
        src = part.get("image_url")
        src = src.get("url") if isinstance(src, dict) else src
    elif kind == "input_image":
        src = part.get("image_url") or part.get("file_id")
    elif kind == "image" and isinstance(part.get("source"), dict):
        src = part["source"].get("data") or part["source"].get("url")
    return src if isinstance(src, str) else None


def _image_mark(part: dict[str, Any]) -> str:
    """An image part as a mark naming the image as sent, so that a request with the same image
    routes where its prefix is cached and different images never look like one prefix. NOTE: a
    fingerprint of slices of the URL or data (a few KB, however large the image): routing is a
    guess, and the router's event loop must not hash megabytes."""
    src = _image_source(part)
    if src is None:
        return ""
    n, k = len(src), 4096
    h = hashlib.blake2b(f"{n}:".encode(), digest_size=8)
    for piece in (src[:k], src[n // 2: n // 2 + k], src[-k:]):
        h.update(piece.encode("utf-8", "replace"))
    return f"{IMAGE_MARK}{h.hexdigest()}|>"


def image_chars(body: dict[str, Any]) -> int:
    """Characters of the body that are images' URLs or data (a request's size less them is its text's)."""
    total = 0
    for m in [*(body.get("messages") or []), *(body.get("input") if isinstance(body.get("input"), list) else [])]:
        content = m.get("content") if isinstance(m, dict) else None
        for part in content if isinstance(content, list) else []:
            src = _image_source(part) if isinstance(part, dict) else None
            total += len(src) if src is not None else 0
    return total


def _turn(role: str, content: str, calls: list[tuple[str, str]] | None = None) -> str:
    return f"<|{role}|>{content}" + "".join(f"<|call|>{n}{a}" for n, a in calls or []) + "\n"


def _tools_text(tools: Any) -> str:
    if not isinstance(tools, list) or not tools:
        return ""
    canon = []
    for t in tools:
        if not isinstance(t, dict):
            continue
        fn = t["function"] if isinstance(t.get("function"), dict) else t  # OpenAI nests it, Anthropic not
        canon.append([fn.get("name"), fn.get("description"), fn.get("parameters", fn.get("input_schema"))])
    return "<|tools|>" + json.dumps(canon, sort_keys=True) + "\n"


def _chat_text(body: dict[str, Any]) -> str:
    out = []
    msgs = [m for m in body.get("messages") or [] if isinstance(m, dict)]
    # A chat template puts the system message first, and the tools with it (or in it).
    if msgs and msgs[0].get("role") in ("system", "developer"):
        out.append(_turn("system", _text(msgs.pop(0).get("content"))))
    out.append(_tools_text(body.get("tools")))
    for m in msgs:
        calls = [(str(c["function"].get("name")), _args(c["function"].get("arguments")))
                 for c in m.get("tool_calls") or [] if isinstance(c, dict) and isinstance(c.get("function"), dict)]
        out.append(_turn(str(m.get("role", "")), _text(m.get("content")), calls))
    return "".join(out)


def _messages_text(body: dict[str, Any]) -> str:
    """An Anthropic conversation as the same text as its OpenAI equivalent: system first, text
    blocks as content, tool_use blocks as calls, each tool_result block as a tool message."""
    out = []
    system = _text(body.get("system"))
    if system:
        out.append(_turn("system", system))
    out.append(_tools_text(body.get("tools")))
    for m in body.get("messages") or []:
        if not isinstance(m, dict):
            continue
        role, content = str(m.get("role", "")), m.get("content")
        if not isinstance(content, list):
            out.append(_turn(role, _text(content)))
            continue
        text: list[str] = []
        calls: list[tuple[str, str]] = []
        for b in content:
            if not isinstance(b, dict):
                continue
            if b.get("type") == "tool_result":
                if text:
                    out.append(_turn(role, "".join(text)))
                    text = []
                out.append(_turn("tool", _text(b.get("content"))))
            elif b.get("type") == "tool_use":
                calls.append((str(b.get("name")), _args(b.get("input") or {})))
            else:
                text.append(_text([b]))
        if text or calls:
            out.append(_turn(role, "".join(text), calls))
    return "".join(out)


def _responses_text(body: dict[str, Any]) -> str:
    """A Responses API request (``/v1/responses``) as the same text as its chat equivalent. A
    follow-up (``previous_response_id``) is keyed by that id: the router has not seen the earlier
    turns' text, so such follow-ups are placed by load, not by prefix."""
    out = []
    if isinstance(body.get("instructions"), str):
        out.append(_turn("system", body["instructions"]))
    out.append(_tools_text(body.get("tools")))
    if isinstance(body.get("previous_response_id"), str):
        out.append(f"<|previous|>{body['previous_response_id']}\n")
    items = body.get("input")
    if isinstance(items, str):
        return "".join(out) + _turn("user", items)
    for it in items if isinstance(items, list) else []:
        if not isinstance(it, dict):
            continue
        kind = it.get("type", "message")
        if kind == "message":
            out.append(_turn(str(it.get("role", "")), _text(it.get("content"))))
        elif kind == "function_call":
            out.append(_turn("assistant", "", [(str(it.get("name")), _args(it.get("arguments")))]))
        elif kind == "function_call_output":
            out.append(_turn("tool", _text(it.get("output"))))
    return "".join(out)


def render_prompt(path: str, body: dict[str, Any]) -> str:
    """The text a replica's prefix cache would hold for this request: every message of a chat (role
    and content, tool calls and results, in order; the same text for OpenAI chat and Anthropic
    messages), or a completion's prompt (the first one of a batch)."""
    if path.endswith("chat/completions"):
        return _chat_text(body)
    if is_anthropic(path):
        return _messages_text(body)
    if path == "/v1/responses":
        return _responses_text(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt:
        prompt = prompt[0] if not isinstance(prompt[0], int) else prompt
        if isinstance(prompt, list):
            return " ".join(str(t) for t in prompt)
    return prompt if isinstance(prompt, str) else ""


def model_scope(body: dict[str, Any]) -> str:
    """The key the prompt text is put under in the router's prefix trees: the requested ``model``
    (a LoRA adapter's name keeps its prefixes apart from the base's and other adapters'), none
    for an unnamed or ``default`` model."""
    model = body.get("model")
    return f"<|model|>{model}\n" if isinstance(model, str) and model not in ("", "default") else ""


def output_budget(body: dict[str, Any]) -> float:
    """The output tokens a request may ask for (all its choices), as counted into a replica's load."""
    limit = (body.get("max_completion_tokens") or body.get("max_tokens") or body.get("max_output_tokens")
             or DEFAULT_OUTPUT_TOKENS)
    n = body.get("n") or 1
    try:
        return float(min(int(limit), 4096) * min(int(n), 16))
    except (TypeError, ValueError):
        return float(DEFAULT_OUTPUT_TOKENS)
