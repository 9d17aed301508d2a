"""Incremental detokenization that never emits half a character.

Byte-level BPE tokens can split a multi-byte UTF-8 character; decoding such a prefix gives
U+FFFD. We decode a short window of recent tokens twice (with and without the newest) and emit
only the new, complete text, holding back while the window ends in a replacement character.
"""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    """Owns one sequence's decode offsets; ``push(ids)`` returns the new text."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix = 0  # start of the context window
        self.read = 0  # tokens already turned into emitted text

    def push(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        before = self._decode(self.ids[self.prefix : self.read])
        full = self._decode(self.ids[self.prefix :])
        if full.endswith("\ufffd") or len(full) <= len(before):
            return ""  # an incomplete character (or nothing visible yet): wait for more
        text = full[len(before) :]
        self.prefix = self.read
        self.read = len(self.ids)
        return text

    def flush(self) -> str:
        """At the end of the sequence: whatever is still held back, replacement chars included."""
        before = self._decode(self.ids[self.prefix : self.read])
        full = self._decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return full[len(before) :] if len(full) > len(before) else ""

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return str(self.tok.decode(ids, skip_special_tokens=self.skip))
