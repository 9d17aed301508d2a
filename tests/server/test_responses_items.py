"""Responses input items without a model: the normal form, and a conversation of items becoming
the ``Message``s chat would build (an assistant's text and the calls after it in one message,
parallel calls together, reasoning items left out, each output a tool message)."""

from __future__ import annotations

import pytest

from tripod.server.api.responses_requests import normal_items, to_messages
from tripod.server.errors import APIError


def test_items_become_the_chat_messages() -> None:
    items = normal_items([
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in "},
                                                        {"type": "input_text", "text": "Paris and Rome?"}]},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "two calls"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{\"city\": \"Paris\"}"},
        {"type": "reasoning", "summary": []},
        {"type": "function_call", "call_id": "c2", "name": "w", "arguments": "{\"city\": \"Rome\"}"},
        {"type": "function_call_output", "call_id": "c1", "output": "18"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "25"}]},
    ])
    assert all(it["id"] for it in items)
    msgs = to_messages(items, "Answer in English.", 0)
    assert [(m.role, m.content) for m in msgs] == [
        ("system", "Answer in English."), ("system", "Be brief."), ("user", "Weather in Paris and Rome?"),
        ("assistant", "Checking."), ("tool", "18"), ("tool", "25")]
    assert [(c.id, c.arguments) for c in msgs[3].tool_calls] == [("c1", '{"city": "Paris"}'), ("c2", '{"city": "Rome"}')]
    assert [m.tool_call_id for m in msgs[4:]] == ["c1", "c2"]


def test_a_call_after_a_tool_result_is_a_new_assistant_turn() -> None:
    items = normal_items([
        {"role": "user", "content": "hi"},
        {"type": "function_call", "call_id": "a", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "a", "output": "1"},
        {"type": "function_call", "call_id": "b", "name": "f", "arguments": "{}"},
    ])
    msgs = to_messages(items, None, 0)
    assert [m.role for m in msgs] == ["user", "assistant", "tool", "assistant"]
    assert [c.id for c in msgs[3].tool_calls] == ["b"]


@pytest.mark.parametrize(("raw", "first_new", "param"), [
    ([{"type": "function_call_output", "call_id": "x", "output": "1"}], 0, "input[0].call_id"),
    ([{"type": "function_call", "call_id": "", "name": "f", "arguments": "{}"}], 0, "input[0].call_id"),
    ([{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}], 0, "input[0].content[0].image_url"),
    ([{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}], 0, "input[0].content[0].file_id"),
    ([{"role": "system", "content": [{"type": "input_image", "image_url": "data:,"}]}], 0, "input[0].content[0]"),
    ([{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}, {"type": "input_file"}]}], 0,
     "input[0].content[1]"),
    ([{"role": "user", "content": 5}], 0, "input[0].content"),
    ([], 0, "input"),
])
def test_bad_items_name_the_parameter(raw: list[dict[str, object]], first_new: int, param: str) -> None:
    with pytest.raises(APIError) as e:
        to_messages(normal_items(raw), None, first_new)  # type: ignore[arg-type]
    assert e.value.status == 400 and e.value.param == param
