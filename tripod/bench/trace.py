"""Recorded sessions to replay: ``tripod bench --dataset trace --trace FILE``.

The file is JSONL: one request per line (blank lines and lines starting with ``#`` are skipped)::

    {"offset": 0.0, "session": "a", "output_tokens": 48,
     "messages": [{"role": "system", "content": "You are ..."}, {"role": "user", "content": "..."}]}
    {"offset": 0.8, "prompt": "Once upon a time", "output_tokens": 16}
    {"offset": 3.1, "session": "a", "output_tokens": 96,
     "messages": [..., {"role": "assistant", "content": "the recorded answer"}, {"role": "user", "content": "..."}]}

- ``offset`` (required, seconds ≥ 0): when the request arrived, relative to the start of the
  recording; the replay sends it at that time after its own start (lines may come in any order).
- ``messages`` (a chat, OpenAI's format: each a ``role`` and its ``content``, plus whatever else the
  API takes, e.g. ``tool_calls``) or ``prompt`` (a completion's text): exactly one. A later turn of a
  conversation carries its whole history as recorded, earlier answers included, so a replay needs
  no answer from the server to build the next request and sends each at its recorded time.
- ``output_tokens`` (required, ≥ 1): the length of the recorded answer. It is sent as
  ``max_tokens`` with ``ignore_eos``, so the replayed answer is exactly as long as the recorded one.
- ``session`` (optional): the conversation a turn belongs to (the report's per-session metric).
- Any other key (the recorded answer, timestamps, ...) is ignored.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from tripod.bench.datasets import BenchRequest


class TraceMessage(BaseModel):
    """One message of a recorded chat: a role and its content (other fields pass through)."""

    model_config = ConfigDict(extra="allow")

    role: str = Field(min_length=1)
    content: str | list[dict[str, Any]] | None = None


class TraceRecord(BaseModel):
    """One line of a trace file (see the module docstring)."""

    model_config = ConfigDict(extra="ignore")

    offset: float = Field(ge=0, allow_inf_nan=False)
    output_tokens: int = Field(ge=1)
    messages: list[TraceMessage] | None = Field(default=None, min_length=1)
    prompt: str | None = None
    session: str | None = None

    @model_validator(mode="after")
    def _one_input(self) -> TraceRecord:
        if (self.messages is None) == (self.prompt is None):
            raise ValueError("give exactly one of 'messages' (a chat) or 'prompt' (a completion)")
        return self

    def request(self) -> BenchRequest:
        messages = [m.model_dump(exclude_none=True) for m in self.messages] if self.messages is not None else None
        # NOTE: ignore_eos (the client's default for fixed lengths) + max_tokens = the recorded
        # length: the replayed answer is as long as the recorded one, never longer or shorter.
        return BenchRequest(self.output_tokens, prompt=self.prompt, messages=messages, session=self.session,
                            offset=self.offset, extra={"ignore_eos": True})


def _why(e: ValidationError) -> str:
    parts = []
    for err in e.errors():
        where = ".".join(str(x) for x in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        parts.append(f"{where}: {msg}" if where else msg)
    return "; ".join(parts)


def load_trace(path: str | Path) -> list[BenchRequest]:
    """The requests of a trace file in offset order (file order among equal offsets); a
    ``ValueError`` naming the file and line of the first bad one."""
    p = Path(path)
    try:
        lines = p.read_text().splitlines()
    except OSError as e:
        raise ValueError(f"--trace {path}: cannot read it ({e.strerror or e})") from None
    out: list[BenchRequest] = []
    for n, line in enumerate(lines, 1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        try:
            raw = json.loads(text)
        except ValueError as e:
            raise ValueError(f"--trace {path}:{n}: not JSON ({e})") from None
        if not isinstance(raw, dict):
            raise ValueError(f"--trace {path}:{n}: each line must be a JSON object")
        try:
            out.append(TraceRecord.model_validate(raw).request())
        except ValidationError as e:
            raise ValueError(f"--trace {path}:{n}: {_why(e)}") from None
    if not out:
        raise ValueError(f"--trace {path}: no requests in it (one JSON object per line)")
    return sorted(out, key=lambda r: r.offset or 0.0)
