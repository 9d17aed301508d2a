"""The server's text side on the real tokenizer: multi-byte UTF-8 and stop strings across tokens."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tripod.loader import load_tokenizer
from tripod.server.answer.text import SeqText, TextSide

TEXT = "Voilà: héllo wörld — 你好世界 🎉🎉 naïve café, «quoted» ∑x² done."


@pytest.fixture(scope="module")
def side() -> TextSide:
    tok = load_tokenizer(None)
    return TextSide(tok.tokenizer, tok.config.vocab_size)


def _run(side: TextSide, text: str, stops: list[str]) -> tuple[list[str], SeqText]:
    ids = side.encode(text, special=False)
    seq = SeqText(side, stops)
    pieces = [seq.push([t], final=(i == len(ids) - 1)) for i, t in enumerate(ids)]
    return pieces, seq


def test_multibyte_characters_are_never_split(side: TextSide) -> None:
    ids = side.encode(TEXT, special=False)
    assert len(ids) > len(TEXT.split())  # the emoji and CJK take several byte-level tokens
    pieces, _ = _run(side, TEXT, [])
    assert "".join(pieces) == TEXT
    assert not any("\ufffd" in p for p in pieces)


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_stop_string_is_never_emitted_even_partly(side: TextSide, data: Any) -> None:
    start = data.draw(st.integers(0, len(TEXT) - 1))
    length = data.draw(st.integers(1, min(12, len(TEXT) - start)))
    stop = TEXT[start : start + length]
    decoy = data.draw(st.sampled_from(["", "zzz", "wörld!", "🎉x"]))
    stops = [stop] + ([decoy] if decoy else [])
    pieces, seq = _run(side, TEXT, stops)
    cut = min(i for i in (TEXT.find(s) for s in stops) if i >= 0)
    assert "".join(pieces) == TEXT[:cut]
    assert seq.stopped


def test_stop_string_not_in_text_flushes_everything(side: TextSide) -> None:
    pieces, seq = _run(side, TEXT, ["done!", "你好世界🎉"])
    assert "".join(pieces) == TEXT and not seq.stopped


def test_piece_bytes_are_exact_for_split_characters(side: TextSide) -> None:
    """Logprob ``bytes`` of the tokens of a text concatenate to its UTF-8, even where a token
    holds only part of a character (its ``token`` text is then U+FFFD)."""
    ids = side.encode(TEXT, special=False)
    assert any("\ufffd" in side.piece(t) for t in ids)  # the emoji/CJK are split across tokens
    assert bytes(b for t in ids for b in side.piece_bytes(t)) == TEXT.encode("utf-8")
