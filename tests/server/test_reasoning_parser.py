"""The reasoning parsers (tripod/server/answer/reasoning.py) without a model: the thinking split from the
answer whatever the pieces the text comes in, the markers never in either part, where an output
starts read from the prompt, the parser chosen per model, and the grammar that constrains only the
answer (compiled with XGrammar against the embedded tokenizer)."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
import torch

from tripod.protocol.sampling import GrammarSpec
from tripod.server.answer.reasoning import (
    DeepSeekR1Parser,
    GptOssParser,
    Qwen3Parser,
    ReasoningParser,
    Split,
    Start,
    Thinking,
    choose_parser,
)


def _pieces(parser: ReasoningParser, start: Start, text: str, size: int) -> Split:
    s = parser.stream(start)
    out = Split()
    for i in range(0, len(text), size):
        out = out + s.feed(text[i:i + size])
    return out + s.finish()


CASES: list[tuple[ReasoningParser, Start, str, Split]] = [
    # Qwen3: a <think> block, whitespace after it dropped.
    (Qwen3Parser(), "maybe", "<think>\nLet me see: 2+2.\n</think>\n\nIt is 4.",
     Split("\nLet me see: 2+2.\n", "It is 4.")),
    # Qwen3 without a block: the text unchanged.
    (Qwen3Parser(), "maybe", "  Just <b>an</b> answer </think> here", Split("", "  Just <b>an</b> answer </think> here")),
    # The template opened the thinking (R1-style prompt ending in <think>): no <think> in the output.
    (Qwen3Parser(), "thinking", "hmm < hm </th </think>{\"a\": 1}", Split("hmm < hm </th ", "{\"a\": 1}")),
    # R1: thinking until </think>, with or without a leading <think>.
    (DeepSeekR1Parser(), "thinking", "<think>a<b</think>\n\nc", Split("a<b", "c")),
    (DeepSeekR1Parser(), "thinking", "a<b</think>c</think>", Split("a<b", "c</think>")),
    # Cut inside the thinking (max_tokens): all of it is thinking, a partial marker included.
    (DeepSeekR1Parser(), "thinking", "still thinking </thi", Split("still thinking </thi", "")),
    # The template closed the thinking (thinking off): all answer.
    (Qwen3Parser(), "answer", "<think>x</think>y", Split("", "<think>x</think>y")),
    # gpt-oss harmony: analysis → thinking, final → answer, headers and markers dropped.
    (GptOssParser(), "maybe",
     "<|channel|>analysis<|message|>User asks 2+2.<|end|><|start|>assistant<|channel|>final<|message|>4<|return|>",
     Split("User asks 2+2.", "4")),
    (GptOssParser(), "maybe", "no channels | at <| all", Split("", "no channels | at <| all")),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_split_is_the_same_in_any_pieces(case: int) -> None:
    parser, start, text, want = CASES[case]
    for size in (1, 2, 3, 7, len(text)):
        assert _pieces(parser, start, text, size) == want, size
    assert Thinking(parser, start).split(text) == want


def test_start_is_read_from_the_prompt() -> None:
    q, r = Qwen3Parser(), DeepSeekR1Parser()
    assert q.start("<|im_start|>assistant\n<think>\n") == "thinking"
    assert q.start("<|im_start|>assistant\n<think>\n\n</think>\n\n") == "answer"
    assert q.start("<|im_start|>assistant\n") == "maybe"
    assert r.start("<｜Assistant｜>") == "thinking"  # R1's older template: the model opens it, or not


def test_the_parser_is_chosen_per_model() -> None:
    assert choose_parser("auto", "{{ '<|im_start|>' }}{% if x %}<think>\n\n</think>{% endif %}", "Qwen3ForCausalLM").name == "qwen3"
    assert choose_parser("auto", "<｜Assistant｜><think>\n", "Qwen2ForCausalLM").name == "deepseek_r1"
    assert choose_parser("auto", "", "GptOssForCausalLM").name == "gpt_oss"
    assert choose_parser("auto", "{{ '<|im_start|>' + m.content }}", "LlamaForCausalLM") is None
    assert choose_parser("none", "<think>", "Qwen3ForCausalLM") is None
    assert choose_parser("deepseek_r1", "", None).name == "deepseek_r1"
    with pytest.raises(ValueError, match="unknown reasoning parser 'r2'"):
        choose_parser("r2", "", None)


@pytest.fixture(scope="module")
def grammars(hf_tokenizer: Any) -> Any:
    from tripod.engine.structured import GrammarBackend

    return GrammarBackend(hf_tokenizer, len(hf_tokenizer), frozenset({hf_tokenizer.eos_token_id}))


SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
          "required": ["answer"], "additionalProperties": False}


@pytest.mark.parametrize("start, opening", [("thinking", ""), ("maybe", "<think>")])
def test_grammar_constrains_only_the_answer(grammars: Any, start: Start, opening: str) -> None:
    g = Thinking(Qwen3Parser(), start).grammar(GrammarSpec("json", json.dumps(SCHEMA)), None)
    assert g is not None
    m = grammars.matcher(grammars.compile_now(g))
    # The thinking is free text, even text the answer's schema forbids (and braces).
    assert m.accept_string(opening + "Maybe {\"answer\": \"perhaps\"}? No.\n</think>\n\n")
    # After it only the schema: the forced part comes at once (jump-forward).
    assert m.find_jump_forward_string() == '{"answer": "'
    assert not m.accept_string('{"answer": "perhaps')
    assert m.accept_string('{"answer": "yes"}')
    assert m.is_terminated() or m.accept_token(grammars.stop_ids[0])


def test_grammar_budget_forces_the_end_of_thinking(grammars: Any, hf_tokenizer: Any) -> None:
    g = Thinking(DeepSeekR1Parser(), "thinking").grammar(None, 3)
    assert g is not None
    m = grammars.matcher(grammars.compile_now(g))
    def allowed() -> list[str]:
        mask = torch.zeros(1, len(hf_tokenizer))
        grammars.apply_masks(mask, [m])
        return [hf_tokenizer.decode([t]) for t in torch.nonzero(mask[0] == 0).flatten().tolist()]

    ids = hf_tokenizer.encode(" one two three", add_special_tokens=False)[:3]
    for t in ids:
        assert len(allowed()) > 1000  # free text
        assert m.accept_token(t)
    # Three tokens of thinking: only the closing marker may follow.
    left = allowed()
    assert left and all("</think>".startswith(p) for p in left), left


def test_no_parser_no_change_to_the_constraint() -> None:
    spec = GrammarSpec("regex", "[a-z]+")
    assert Thinking(Qwen3Parser(), "answer").grammar(spec, None) == spec
    assert Thinking(Qwen3Parser(), "maybe").grammar(None, None) is None


def test_harmony_markers_are_tokens(hf_tokenizer: Any) -> None:
    """gpt-oss: the markers are special tokens; the grammar names them as tokens, and the text side
    keeps them for the splitter (which drops them)."""
    from tripod.engine.structured import GrammarBackend
    from tripod.server.answer.text import SeqText, TextSide

    tok = copy.deepcopy(hf_tokenizer)
    tok.add_special_tokens({"additional_special_tokens": ["<|channel|>", "<|message|>", "<|end|>", "<|start|>",
                                                          "<|return|>"]})
    ret = tok.convert_tokens_to_ids("<|return|>")
    grammars = GrammarBackend(tok, len(tok), frozenset({ret}))
    thinking = Thinking(GptOssParser(), "maybe")
    g = thinking.grammar(GrammarSpec("regex", "[a-z]+"), None)
    assert g is not None
    text = "<|channel|>analysis<|message|>I think so.<|end|><|start|>assistant<|channel|>final<|message|>"
    ids = [*tok.encode(text + "yes", add_special_tokens=False), ret]
    m = grammars.matcher(grammars.compile_now(g))
    assert all(m.accept_token(t) for t in ids) and m.is_terminated()
    m = grammars.matcher(grammars.compile_now(g))
    assert not all(m.accept_token(t) for t in tok.encode(text + "YES", add_special_tokens=False))
    seq = SeqText(TextSide(tok, len(tok)), [], special=True)
    assert thinking.split(seq.push(ids, final=True)) == Split("I think so.", "yes")
