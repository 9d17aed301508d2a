"""Engine deltas → a Responses API answer: output items and the typed event stream.

``ResponseBuilder`` is fed the deltas of one generation (one choice). It splits the thinking off
(``Thinking``: a ``reasoning`` item), reads tool calls (``ToolCallStream``: ``function_call``
items) and the rest as a ``message`` item with one ``output_text`` part, and emits OpenAI's
events in order, each with its ``sequence_number``: ``response.created``,
``response.in_progress``, then per item ``output_item.added`` → (``content_part.added`` →
``output_text.delta``… → ``output_text.done`` → ``content_part.done`` | ``reasoning_text.*`` |
``function_call_arguments.delta``… → ``.done``) → ``output_item.done``, and last
``response.completed`` / ``response.incomplete`` / ``response.failed`` with the whole response.

A whole (non-streamed) answer is the same builder's last snapshot, so a streamed and a whole answer
are the same. NOTE: text is fed to the splitter and the parser delta by delta; both emit after a
prefix of the text what that prefix alone decides, so the items equal a whole-text parse (as chat's
``parse_all``).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import Any

from tripod.protocol.engine_ipc import Logprob
from tripod.server.answer.generation import Delta, chat_logprobs, new_id
from tripod.server.answer.reasoning import ReasoningStream, Split, Thinking
from tripod.server.answer.text import TextSide
from tripod.server.answer.tools import (
    ArgsPiece,
    CallEnd,
    CallStart,
    TextPiece,
    ToolCallParser,
    ToolCallStream,
)

Event = dict[str, Any]


class ResponseBuilder:
    """Owns one response's output items, its status and the sequence numbers of its events."""

    def __init__(self, base: dict[str, Any], text: TextSide, parser: ToolCallParser | None,
                 think: Thinking | None, logprobs: bool) -> None:
        self.body: dict[str, Any] = {**base, "status": "in_progress", "output": [], "usage": None}
        self.text, self.logprobs = text, logprobs
        self.tools: ToolCallStream | None = parser.stream(lambda: new_id("call", "_")) if parser else None
        self.thoughts: ReasoningStream | None = think.stream() if think is not None else None
        self.seq = 0
        self.open: dict[str, Any] | None = None  # the item being written
        self.pending: list[Logprob] = []  # logprobs of tokens whose text has not been shown yet
        self.reasoning_tokens = 0
        self.events: list[Event] = []

    # ------------------------------------------------------------------ events
    def _emit(self, kind: str, **fields: Any) -> None:
        self.events.append({"type": kind, "sequence_number": self.seq, **fields})
        self.seq += 1

    def take(self) -> list[Event]:
        out, self.events = self.events, []
        return out

    def snapshot(self) -> dict[str, Any]:
        return copy.deepcopy(self.body)

    def start(self) -> list[Event]:
        self._emit("response.created", response=self.snapshot())
        self._emit("response.in_progress", response=self.snapshot())
        return self.take()

    # ------------------------------------------------------------------ deltas
    def feed(self, d: Delta) -> list[Event]:
        final = d.finish_reason is not None
        self.pending.extend(d.logprobs)
        text = d.text
        if self.thoughts is not None:
            split = self.thoughts.feed(text) + (self.thoughts.finish() if final else Split())
            if split.reasoning:
                self._reasoning(split.reasoning)
                if not split.content:
                    self.reasoning_tokens += len(d.token_ids)
            text = split.content
        if self.tools is None:
            self._text(text)
        else:
            for e in self.tools.feed(text) + (self.tools.finish() if final else []):
                if isinstance(e, TextPiece):
                    self._text(e.text)
                elif isinstance(e, CallStart):
                    self._open_item({"id": new_id("fc", "_"), "type": "function_call", "status": "in_progress",
                                     "arguments": "", "call_id": e.id, "name": e.name})
                elif isinstance(e, ArgsPiece):
                    self._args(e.text)
                elif isinstance(e, CallEnd):
                    self._close("completed" if e.complete else "incomplete")
        return self.take()

    def _open_item(self, item: dict[str, Any]) -> int:
        self._close("completed")
        self.body["output"].append(item)
        self.open = item
        self._emit("response.output_item.added", output_index=len(self.body["output"]) - 1, item=dict(item))
        return len(self.body["output"]) - 1

    def _where(self) -> dict[str, Any]:
        assert self.open is not None
        return {"item_id": self.open["id"], "output_index": len(self.body["output"]) - 1}

    def _reasoning(self, text: str) -> None:
        if self.open is None or self.open["type"] != "reasoning":
            self._open_item({"id": new_id("rs", "_"), "type": "reasoning", "summary": [], "content": [],
                             "status": "in_progress"})
            assert self.open is not None
            self.open["content"].append({"type": "reasoning_text", "text": ""})
            self._emit("response.content_part.added", **self._where(), content_index=0,
                       part={"type": "reasoning_text", "text": ""})
        assert self.open is not None
        self.open["content"][0]["text"] += text
        self._emit("response.reasoning_text.delta", **self._where(), content_index=0, delta=text)

    def _text(self, text: str) -> None:
        if not text:
            return
        if self.open is None or self.open["type"] != "message":
            self._open_item({"id": new_id("msg", "_"), "type": "message", "role": "assistant",
                             "status": "in_progress", "content": []})
            assert self.open is not None
            part: dict[str, Any] = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            self.open["content"].append(part)
            self._emit("response.content_part.added", **self._where(), content_index=0,
                       part={**part, "logprobs": []})
        assert self.open is not None
        lps = self._logprobs()
        part = self.open["content"][0]
        part["text"] += text
        part["logprobs"] += lps
        self._emit("response.output_text.delta", **self._where(), content_index=0, delta=text, logprobs=lps)

    def _logprobs(self) -> list[dict[str, Any]]:
        out, self.pending = self.pending, []
        return chat_logprobs(self.text, out) if self.logprobs else []

    def _args(self, text: str) -> None:
        assert self.open is not None and self.open["type"] == "function_call"
        self.open["arguments"] += text
        self._emit("response.function_call_arguments.delta", **self._where(), delta=text)

    def _close(self, status: str) -> None:
        item = self.open
        if item is None:
            return
        where = self._where()
        if item["type"] == "message":
            part = item["content"][0]
            part["logprobs"] += self._logprobs()
            self._emit("response.output_text.done", **where, content_index=0, text=part["text"],
                       logprobs=part["logprobs"])
            self._emit("response.content_part.done", **where, content_index=0, part=dict(part))
        elif item["type"] == "reasoning":
            part = item["content"][0]
            self._emit("response.reasoning_text.done", **where, content_index=0, text=part["text"])
            self._emit("response.content_part.done", **where, content_index=0, part=dict(part))
        else:
            self._emit("response.function_call_arguments.done", **where, arguments=item["arguments"],
                       name=item["name"])
        item["status"] = status
        self.open = None
        self._emit("response.output_item.done", output_index=where["output_index"], item=dict(item))

    # ------------------------------------------------------------------ the end
    def finish(self, finish_reason: str | None, usage: dict[str, Any]) -> list[Event]:
        """The last events: the open item closed, then the whole response."""
        cut = finish_reason == "length"
        self._close("incomplete" if cut else "completed")
        self.body["usage"] = {
            "input_tokens": usage["prompt_tokens"],
            "input_tokens_details": usage["prompt_tokens_details"],  # cached_tokens (+ image_tokens with images)
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
            "total_tokens": usage["total_tokens"],
        }
        self.body["completed_at"] = int(time.time())
        if cut:
            self.body["status"] = "incomplete"
            self.body["incomplete_details"] = {"reason": "max_output_tokens"}
            self._emit("response.incomplete", response=self.snapshot())
        else:
            self.body["status"] = "completed"
            self._emit("response.completed", response=self.snapshot())
        return self.take()

    def fail(self, code: str, message: str, status: str = "failed") -> list[Event]:
        """The answer cannot go on (``status`` ``cancelled``: stopped by ``/cancel``)."""
        self._close("incomplete")
        self.body["status"] = status
        if status == "failed":
            self.body["error"] = {"code": code, "message": message}
            self._emit("response.failed", response=self.snapshot())
        return self.take()


def output_text(body: dict[str, Any]) -> str:
    """The text of a response's message items (what the SDKs call ``output_text``)."""
    return "".join(p["text"] for it in body.get("output", []) if it["type"] == "message"
                   for p in it["content"] if p["type"] == "output_text")


def events_sse(events: list[Event], encode: Callable[[dict[str, Any]], bytes]) -> bytes:
    """Events as SSE frames (``event:`` the type, ``data:`` the event)."""
    return b"".join(b"event: " + e["type"].encode() + b"\n" + encode(e) for e in events)
