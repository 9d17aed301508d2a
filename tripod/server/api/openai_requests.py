"""The OpenAI surface's request models (strict pydantic, on ``body.StrictModel``) and the
OpenAI-specific checks and translations: messages → ``Message``s, tools → ``ToolSpec``s and a
``ToolChoice``, output constraints → a ``GrammarSpec``. The routes are ``openai.py``'s.

Types are checked by pydantic in strict mode (``"5"`` is not a number, ``true`` is not 1);
ranges are ``SamplingParams``' own (``api/sampling.py``), cross-field rules are checked here
with messages that say what to change. Unknown fields are ignored, as OpenAI-compatible servers
do, so clients that send newer fields keep working; known OpenAI features tripod does not
implement are refused by name rather than ignored.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field

from tripod.protocol.sampling import GrammarSpec
from tripod.server.answer.conversation import Message, PastCall
from tripod.server.answer.tools import ToolChoice, ToolSpec, check_choice, check_tools
from tripod.server.api.body import StrictModel, one_of
from tripod.server.errors import APIError
from tripod.server.media.sources import ImageRef, check_detail, check_url

ROLES = ("system", "developer", "user", "assistant", "tool")


class StreamOptions(StrictModel):
    include_usage: bool = False


class ImageURL(StrictModel):
    url: str  # a data: URL (data:image/png;base64,...) or an http(s) URL (--allowed-media-domains)
    detail: str | None = None  # auto, low or high: the processor decides what each means


class ContentPart(StrictModel):
    type: str = one_of("text", "image_url")
    text: str | None = None
    image_url: ImageURL | str | None = None  # (vLLM also takes the URL as a plain string)


class CallFunction(StrictModel):
    name: str
    arguments: str | dict[str, Any]  # a JSON string, as OpenAI sends it (an object is accepted)


class MessageToolCall(StrictModel):
    id: str
    type: str = "function"
    function: CallFunction


class ChatMessage(StrictModel):
    role: str = one_of(*ROLES)
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # role "assistant"
    tool_call_id: str | None = None  # role "tool"


class FunctionDef(StrictModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(StrictModel):
    type: str = one_of("function")
    function: FunctionDef


class NamedFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: str = one_of("function")
    function: NamedFunction


class _Sampling(StrictModel):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    priority: int = 0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    metadata: dict[str, Any] | None = None
    # tripod's extension: false decodes this request plainly on a server started with
    # --speculative (its outputs are the same either way; only the speed differs).
    speculative: bool = True


class StructuredOutputs(StrictModel):
    """vLLM's ``structured_outputs`` object (one of its fields)."""

    json_schema: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class ResumedChoice(StrictModel):
    """One choice of a continued answer: what it had produced before (on another replica)."""

    index: int
    token_ids: list[int]
    # Streams: how many characters of the choice's text the client has been sent (the new
    # stream starts right after them). Whole answers: None (the answer is rebuilt in full).
    chars: int | None = None
    # Whole answers: the raw logprobs of token_ids ([id, logprob, [[id, logprob], ...]] each),
    # when the request asks for logprobs. (Their shape is checked where they are used.)
    logprobs: list[list[Any]] | None = None
    finish_reason: str | None = None  # set: the choice had finished (nothing more to generate)


class Continuation(StrictModel):
    """tripod's extension ``tripod_continuation`` (the router's failover): answer this request as
    the continuation of one that another replica started, whose ``id`` and ``created`` the answer
    keeps. Each listed choice resumes from its tokens; unlisted choices start afresh."""

    id: str
    created: int
    choices: list[ResumedChoice]


class _Constrained(_Sampling):
    response_format: dict[str, Any] | None = None
    regex: str | None = None
    ebnf: str | None = None
    choice: list[str] | None = None
    structured_outputs: StructuredOutputs | None = None
    # vLLM's older names, accepted so its users can switch unchanged.
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # tripod's extensions. return_token_ids: every choice carries the ids of its tokens
    # ("token_ids": in each stream chunk the new ones, in a whole answer all of them).
    return_token_ids: bool = False
    # The router's failover (tripod.router): stream chunks carry each choice's resume point, and a
    # whole answer comes as an event stream of progress ending in the answer itself.
    tripod_failover: bool = False
    tripod_continuation: Continuation | None = None


class ChatCompletionRequest(_Constrained):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[ToolDef] | None = None
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None  # OpenAI's deprecated function calling: refused by name
    function_call: Any = None
    # tripod's extension (models with a reasoning parser): at most this many tokens of thinking,
    # then the end of the thinking is forced (as Anthropic's thinking.budget_tokens).
    thinking_budget: int | None = None


class CompletionRequest(_Constrained):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None
    # --enable-rl-api (routing replay): every choice carries "routed_experts", per computed position
    # (the prompt, then the output but its last token) per MoE layer the top-k expert ids.
    return_routed_experts: bool = False


def chat_messages(messages: list[ChatMessage]) -> list[Message]:
    """OpenAI messages → ``Message``s (string content, tool calls and results kept)."""
    if not messages:
        raise APIError(400, "'messages' must hold at least one message", param="messages")
    out: list[Message] = []
    for i, m in enumerate(messages):
        if m.role not in ROLES:
            raise APIError(
                400, f"messages[{i}].role {m.role!r} is unknown; use one of {', '.join(ROLES)}",
                param=f"messages.{i}.role",
            )
        content, parts = m.content, None
        if isinstance(content, list):
            parts = _parts(content, m.role, i)
            content = "".join(p for p in parts if isinstance(p, str))
        if content is None:
            if m.role != "assistant":
                raise APIError(400, f"messages[{i}].content is required", param=f"messages.{i}.content")
            content = ""
        calls = []
        if m.tool_calls:
            if m.role != "assistant":
                raise APIError(400, f"messages[{i}]: only assistant messages carry 'tool_calls'",
                               param=f"messages.{i}.tool_calls")
            for c in m.tool_calls:
                args = c.function.arguments
                calls.append(PastCall(c.id, c.function.name, args if isinstance(args, str) else json.dumps(args)))
        if m.role == "tool" and not m.tool_call_id:
            raise APIError(400, f"messages[{i}]: a 'tool' message needs the 'tool_call_id' of the call it "
                           "answers", param=f"messages.{i}.tool_call_id")
        out.append(Message("system" if m.role == "developer" else m.role, content, calls,
                           m.tool_call_id if m.role == "tool" else None, m.name,
                           parts if parts and any(isinstance(p, ImageRef) for p in parts) else None))
    return out


def _parts(content: list[ContentPart], role: str, i: int) -> list[str | ImageRef]:
    """A message's content parts in order: text, and (user messages) images."""
    out: list[str | ImageRef] = []
    for j, part in enumerate(content):
        at = f"messages.{i}.content.{j}"
        if part.type == "text" and part.text is not None:
            out.append(part.text)
        elif part.type == "image_url":
            if role != "user":
                raise APIError(400, f"messages[{i}]: images go in user messages; a {role} message's content is "
                               "text", param=at)
            out.append(openai_image(part.image_url, at))
        else:
            raise APIError(400, f"messages[{i}]: content parts of type {part.type!r} are not supported (or lack "
                           "their field); send text parts ({\"type\": \"text\", \"text\": ...}) and image_url parts",
                           param=at)
    return out


def openai_image(image_url: ImageURL | str | None, at: str) -> ImageRef:
    """An ``image_url`` content part's image (not fetched: ``server/media`` loads it)."""
    if image_url is None:
        raise APIError(400, f"'{at}.image_url' is required: {{\"url\": \"data:image/png;base64,...\"}} or an http(s) "
                       "URL", param=f"{at}.image_url")
    if isinstance(image_url, str):
        return ImageRef(f"{at}.image_url", url=check_url(image_url, f"{at}.image_url"))
    where = f"{at}.image_url.url"
    return ImageRef(where, url=check_url(image_url.url, where),
                    detail=check_detail(image_url.detail, f"{at}.image_url.detail"))


def openai_tools(req: ChatCompletionRequest, default_parallel: bool = True) -> tuple[list[ToolSpec], ToolChoice]:
    """``tools`` / ``tool_choice`` / ``parallel_tool_calls`` → checked tools and choice (an unset
    ``parallel_tool_calls`` means ``default_parallel``)."""
    if req.functions is not None or req.function_call is not None:
        raise APIError(400, "'functions' / 'function_call' (OpenAI's deprecated function calling) are not "
                       "supported; send 'tools' and 'tool_choice'", param="functions")
    raw = []
    for i, t in enumerate(req.tools or []):
        if t.type != "function":
            raise APIError(400, f"tools[{i}].type must be 'function' (got {t.type!r})", param=f"tools.{i}.type")
        raw.append((t.function.name, t.function.description, t.function.parameters))
    tools = check_tools(raw, "tools")
    parallel = default_parallel if req.parallel_tool_calls is None else req.parallel_tool_calls
    tc = req.tool_choice
    if tc is None:
        choice = ToolChoice("auto" if tools else "none", parallel=parallel)
    elif isinstance(tc, str):
        if tc not in ("auto", "none", "required"):
            raise APIError(400, f"'tool_choice' must be 'auto', 'none', 'required' or "
                           f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}} (got {tc!r})",
                           param="tool_choice")
        choice = ToolChoice(tc, parallel=parallel)  # type: ignore[arg-type]
    else:
        if tc.type != "function":
            raise APIError(400, f"'tool_choice.type' must be 'function' (got {tc.type!r})", param="tool_choice")
        choice = ToolChoice("named", tc.function.name, parallel=False)
    if choice.mode == "auto" and not tools:
        choice = ToolChoice("none")
    return tools, check_choice(choice, tools, "tool_choice")


def grammar_spec(req: _Constrained) -> GrammarSpec | None:
    """The request's output constraint as a ``GrammarSpec``,
    from whichever of OpenAI's ``response_format``, tripod's ``regex``/``ebnf``/``choice`` or
    vLLM's ``structured_outputs``/``guided_*`` the request used; None if unconstrained."""
    found: list[tuple[str, str, str]] = []  # (param, kind, value)
    rf = req.response_format
    if rf is not None:
        kind = rf.get("type")
        if kind == "json_object":
            found.append(("response_format", "json", ""))
        elif kind == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict) or not isinstance(js.get("schema"), dict):
                raise APIError(400, "'response_format.json_schema' must be an object with a 'schema' object "
                               "(and optionally 'name' and 'strict')", param="response_format.json_schema")
            found.append(("response_format", "json", json.dumps(js["schema"])))
        elif kind != "text":
            raise APIError(
                400, "'response_format.type' must be 'text', 'json_object' or 'json_schema' "
                f"(got {kind!r})", param="response_format.type",
            )
    so = req.structured_outputs
    candidates: list[tuple[str, str, Any]] = [
        ("regex", "regex", req.regex), ("ebnf", "ebnf", req.ebnf), ("choice", "choice", req.choice),
        ("guided_json", "json", req.guided_json), ("guided_regex", "regex", req.guided_regex),
        ("guided_choice", "choice", req.guided_choice), ("guided_grammar", "ebnf", req.guided_grammar),
    ]
    if so is not None:
        candidates += [
            ("structured_outputs.json", "json", so.json_schema), ("structured_outputs.regex", "regex", so.regex),
            ("structured_outputs.choice", "choice", so.choice), ("structured_outputs.grammar", "ebnf", so.grammar),
            ("structured_outputs.json_object", "json", "" if so.json_object else None),
        ]
    for param, kind, value in candidates:
        if value is None:
            continue
        if kind == "json" and isinstance(value, str) and value:
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise APIError(400, f"'{param}' is not valid JSON: {e}", param=param) from None
        if kind == "json" and not isinstance(value, (dict, str)):
            raise APIError(400, f"'{param}' must be a JSON schema object", param=param)
        if kind == "choice":
            if not value or not all(isinstance(c, str) and c for c in value):
                raise APIError(400, f"'{param}' must be a non-empty list of non-empty strings", param=param)
            value = json.dumps(value, ensure_ascii=False)
        elif kind == "json":
            value = json.dumps(value) if isinstance(value, dict) else value
        elif not value:
            raise APIError(400, f"'{param}' must not be empty", param=param)
        found.append((param, kind, value))
    if len(found) > 1:
        raise APIError(400, f"give one output constraint, not several ({', '.join(p for p, _, _ in found)})",
                       param=found[1][0])
    if not found:
        return None
    _, kind, value = found[0]
    return GrammarSpec(kind, value)


FinishReasonT = Literal["stop", "length", "tool_calls"]
