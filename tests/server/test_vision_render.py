"""Conversations with images, before any image is loaded: each API's parts become ``Message.parts``
in order (text and ``ImageRef``s naming where they are), and a vision-language model's template is
given every message's content as parts, so it writes one placeholder per image and keeps the text
of text-only messages (LLaVA's template renders nothing of a plain string)."""

from __future__ import annotations

from typing import Any

from tests.support.vision_fakes import tokenizer
from tripod.server.answer.conversation import ChatRenderer, Message
from tripod.server.answer.text import TextSide
from tripod.server.answer.tools import ToolSpec
from tripod.server.api.anthropic_requests import MessagesRequest, conversation
from tripod.server.api.openai_requests import ChatMessage, chat_messages
from tripod.server.api.responses_requests import normal_items, to_messages
from tripod.server.media.sources import ImageRef

# The shape of llava-hf's templates: images first, then text, read from content parts only.
LLAVA_LIKE = ("{% for message in messages %}{{ message['role'].upper() + ': ' }}"
              "{% for c in message['content'] | selectattr('type', 'equalto', 'image') %}<image>\n{% endfor %}"
              "{% for c in message['content'] | selectattr('type', 'equalto', 'text') %}{{ c['text'] + ' ' }}{% endfor %}"
              "{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}")


def renderer(template: str | None = None, parts: bool = True) -> tuple[ChatRenderer, Any]:
    tok = tokenizer()
    if template is not None:
        tok.chat_template = template
    return ChatRenderer(TextSide(tok, len(tok)), parts=parts), tok


def shape(m: Message) -> list[str]:
    return [p if isinstance(p, str) else f"<{p.param}>" for p in m.parts or [m.content]]


def test_openai_parts_in_order() -> None:
    msgs = chat_messages([ChatMessage.model_validate(m, strict=True) for m in [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {
            "url": "data:image/png;base64,AA", "detail": "low"}}, {"type": "text", "text": "b"},
            {"type": "image_url", "image_url": "https://x/y.png"}]},
        {"role": "user", "content": [{"type": "text", "text": "only text"}]}]])
    assert shape(msgs[1]) == ["a", "<messages.1.content.1.image_url.url>", "b", "<messages.1.content.3.image_url>"]
    assert msgs[1].content == "ab" and msgs[1].images[0].detail == "low" and msgs[1].images[1].url == "https://x/y.png"
    assert msgs[2].parts is None and msgs[0].parts is None


def test_anthropic_parts_in_order_around_tool_results() -> None:
    req = MessagesRequest.model_validate({"model": "m", "max_tokens": 4, "messages": [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "shot", "input": {}}]},
        {"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "https://x/before.png"}},
            {"type": "tool_result", "tool_use_id": "t", "content": "taken"},
            {"type": "text", "text": "this one:"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/webp", "data": "AAAA"}}]}]},
        strict=True)
    msgs, _, _, _ = conversation(req)
    assert [m.role for m in msgs] == ["user", "assistant", "user", "tool", "user"]
    assert shape(msgs[2]) == ["<messages.2.content.0.source.url>"]
    assert shape(msgs[4]) == ["this one:", "<messages.2.content.3.source.data>"]
    assert msgs[4].images[0].b64 == "AAAA"


def test_responses_parts_and_history_name_where_they_are() -> None:
    items = normal_items([{"role": "user", "content": [
        {"type": "input_text", "text": "see"}, {"type": "input_image", "image_url": "https://x/a.png", "detail": "high"}]}])
    assert items[0]["content"][1] == {"type": "input_image", "image_url": "https://x/a.png", "detail": "high"}
    now = to_messages(items, None, 0)
    assert shape(now[0]) == ["see", "<input[0].content[1].image_url>"] and now[0].images[0].detail == "high"
    later = to_messages([*items, *normal_items("and?")], None, 1)  # the first item is history now
    assert shape(later[0]) == ["see", "<previous_response_id (item 0).content[1].image_url>"]


def test_a_vlm_template_gets_parts_for_every_message() -> None:
    r, tok = renderer(LLAVA_LIKE)
    msgs = [Message("user", "just text"),
            Message.of_parts("user", ["what is", ImageRef("p", url="data:,"), "this?"])]
    text = tok.decode(r.render(msgs), skip_special_tokens=False)
    assert text == "USER: just text USER: <image>\nwhat is this? ASSISTANT:"
    plain, _ = renderer(LLAVA_LIKE, parts=False)  # (a text-only model's renderer: strings, as before)
    assert tok.decode(plain.render([Message("user", "just text")])) == "USER: ASSISTANT:"


def test_generic_tools_on_a_vlm_keep_the_images() -> None:
    r, tok = renderer()
    tools = [ToolSpec("shot", "take a screenshot", {"type": "object", "properties": {}})]
    msgs = [Message.of_parts("user", [ImageRef("p", url="data:,"), "what now?"])]
    text = tok.decode(r.render(msgs, tools), skip_special_tokens=False)
    assert text.count("<image>") == 1 and "shot" in text and text.index("shot") < text.index("<image>")
