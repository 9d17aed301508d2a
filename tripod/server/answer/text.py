"""The server's text side: tokenization, chat templates, detokenization and stop strings.

The engine speaks token ids; everything textual happens here, in the HTTP process.
"""

from __future__ import annotations

from typing import Any

from tripod.detokenizer import IncrementalDetokenizer


class ChatTemplateError(ValueError):
    """The model's chat template refused the conversation (its message says why)."""


class TextSide:
    """Owns the tokenizer of the served model: prompts in, token text out."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._piece_cache: dict[int, str] = {}

    def encode(self, text: str, *, special: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=special))

    @property
    def template(self) -> str:
        """The chat template's source ("" if the tokenizer has none)."""
        t = getattr(self.tokenizer, "chat_template", None)
        if isinstance(t, dict):  # several named templates: the default one
            t = t.get("default") or next(iter(t.values()), "")
        return t if isinstance(t, str) else ""

    def chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        *,
        tools: list[dict[str, Any]] | None = None,
        continue_final: bool = False,
    ) -> list[int]:
        """Render a conversation with the model's template. ``tools`` go to templates that take
        them; ``continue_final``: the last (assistant) message is continued, not closed."""
        import jinja2

        kw: dict[str, Any] = {}
        if tools:
            kw["tools"] = tools
        if continue_final:
            kw["continue_final_message"] = True
            add_generation_prompt = False
        try:
            text = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=False, **kw
            )
        except (jinja2.TemplateError, ValueError, TypeError, KeyError) as e:
            raise ChatTemplateError(f"the model's chat template rejected the messages: {e}") from e
        # NOTE: the template already wrote any BOS it wants; adding special tokens again would
        # double it.
        return self.encode(str(text), special=False)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))

    def piece(self, token_id: int) -> str:
        """One token's own text (for logprobs); may be part of a multi-byte character."""
        s = self._piece_cache.get(token_id)
        if s is None:
            s = self._piece_cache[token_id] = str(self.tokenizer.decode([token_id]))
        return s

    def piece_bytes(self, token_id: int) -> list[int]:
        """The token's own UTF-8 bytes: exact even for a piece of a multi-byte character
        (byte-level BPE vocabularies spell each byte as one printable character)."""
        s = self.piece(token_id)
        if "\ufffd" in s:
            raw = self.tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(raw, str) and all(ch in _BYTE_OF_CHAR for ch in raw):
                return [_BYTE_OF_CHAR[ch] for ch in raw]
        return list(s.encode("utf-8"))

    def check_ids(self, ids: list[int], what: str) -> None:
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"{what} contains token id {bad}, outside the vocabulary [0, {self.vocab_size})")


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte (the GPT-2 scheme): printable Latin-1
    bytes stand for themselves, the others are shifted to code points from 256 up."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out = {chr(b): b for b in keep}
    extra = 0
    for b in range(256):
        if b not in keep:
            out[chr(256 + extra)] = b
            extra += 1
    return out


_BYTE_OF_CHAR = _byte_level_alphabet()


class SeqText:
    """Turns one sequence's tokens into text, honouring stop strings.

    Invariant: no emitted text ever contains a stop string or the start of one that may still
    complete: text that could begin a stop string is held back until the next token decides it.
    """

    def __init__(self, text: TextSide, stop: list[str], special: bool = False) -> None:
        # special: special tokens stay in the text (a reasoning parser whose markers are special
        # tokens, e.g. gpt-oss's harmony channels, reads them there and drops them).
        self.detok = IncrementalDetokenizer(text.tokenizer, skip_special_tokens=not special)
        self.stop = stop
        self.held = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text

    def push(self, ids: list[int], final: bool = False) -> str:
        """Feed new tokens; returns the text that may be shown now. Sets ``stopped`` on a match."""
        if self.stopped:
            return ""
        self.held += self.detok.push(ids)
        if final:
            self.held += self.detok.flush()
        if not self.stop:
            out, self.held = self.held, ""
            return out
        found = [(i, s) for s in self.stop if (i := self.held.find(s)) >= 0]
        cut = min(found)[0] if found else -1
        if cut >= 0:
            self.stopped = True
            self.matched = min(found)[1]
            out, self.held = self.held[:cut], ""
            return out
        if final:
            out, self.held = self.held, ""
            return out
        keep = _longest_stop_prefix_suffix(self.held, self.stop)
        out = self.held[: len(self.held) - keep]
        self.held = self.held[len(self.held) - keep :]
        return out


def _longest_stop_prefix_suffix(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best
