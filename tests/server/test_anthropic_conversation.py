"""What an Anthropic conversation becomes as chat messages when past thinking blocks are in it:
they are left out of the prompt; an assistant turn of only thinking is not one to continue, and a
conversation with nothing left to prompt with is a 400, not a server error."""

from __future__ import annotations

import json

import pytest

from tripod.server.api.anthropic_requests import MessagesRequest, conversation
from tripod.server.api.body import parse
from tripod.server.errors import APIError

THINK = {"type": "thinking", "thinking": "Let me see.", "signature": "sig"}


def _conv(messages: list[dict[str, object]], **kw: object) -> tuple[list[tuple[str, str]], bool]:
    req = parse(MessagesRequest, json.dumps({"model": "m", "max_tokens": 8, "messages": messages, **kw}).encode())
    msgs, _, _, cont = conversation(req)
    return [(m.role, m.content) for m in msgs], cont


def test_past_thinking_is_left_out_and_the_answer_after_it_continued() -> None:
    got = _conv([{"role": "user", "content": "Hi"},
                 {"role": "assistant", "content": [THINK, {"type": "text", "text": "Hello"}]}])
    assert got == ([("user", "Hi"), ("assistant", "Hello")], True)


def test_an_assistant_turn_of_only_thinking_is_answered_anew() -> None:
    got = _conv([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": [THINK]}])
    assert got == ([("user", "Hi")], False)


@pytest.mark.parametrize("system", [None, "Be brief."])
def test_nothing_left_to_prompt_with_is_a_400(system: str | None) -> None:
    kw = {"system": system} if system else {}
    with pytest.raises(APIError) as e:
        _conv([{"role": "assistant", "content": [THINK]}], **kw)
    assert e.value.status == 400 and "nothing to prompt with" in str(e.value)
