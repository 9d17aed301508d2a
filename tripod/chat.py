"""The terminal chat of ``tripod chat`` and ``tripod generate``: answers streamed as they come,
from an in-process engine or from a running server's /v1/chat/completions."""

from __future__ import annotations

import sys
import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from tripod.config import SamplingOptions
    from tripod.engine.engine import Engine, Prompt
    from tripod.engine.request import SamplingParams


def stream_answer(engine: Engine, prompt: Prompt, params: SamplingParams, show_stats: bool) -> str:
    """Stream one answer to stdout as it is generated; with ``show_stats``, its token counts and speed
    to stderr. Returns the answer's text."""
    t0 = time.monotonic()
    first = None
    text: list[str] = []
    ntok = 0
    cached = 0
    reason = None
    for d in engine.stream(prompt, params):
        if first is None:
            first = time.monotonic()
        ntok += len(d.token_ids)
        cached = d.cached_tokens
        text.append(d.text)
        sys.stdout.write(d.text)
        sys.stdout.flush()
        reason = d.finish_reason or reason
    sys.stdout.write("\n")
    if show_stats:
        dt = time.monotonic() - t0
        ttft = (first or t0) - t0
        rate = (ntok - 1) / (dt - ttft) if ntok > 1 and dt > ttft else 0.0
        print(
            f"[{ntok} tokens, finish={reason}, cached prompt tokens={cached}, "
            f"TTFT {ttft * 1000:.0f} ms, {rate:.1f} tok/s]",
            file=sys.stderr,
        )
    return "".join(text)


class TooLong(Exception):
    """The conversation no longer fits the context."""


class LocalChat:
    """Chat turns on an in-process engine."""

    def __init__(self, engine: Engine, params: SamplingParams) -> None:
        self.engine = engine
        self.params = params
        self.label = f"{engine.model_name} ({engine.dtype_name}, in-process)"

    def answer(self, history: list[dict[str, str]]) -> str:
        prompt = self.engine.apply_chat_template(history)
        if len(prompt) + 1 >= self.engine.max_request_len:
            raise TooLong()
        return stream_answer(self.engine, prompt, self.params, True)


class RemoteChat:
    """Chat turns against a running server's /v1/chat/completions, streamed."""

    def __init__(self, url: str, api_key: str | None, sampling: SamplingOptions) -> None:
        import httpx

        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=httpx.Timeout(10.0, read=None))
        try:
            models = self.http.get("/v1/models")
        except httpx.HTTPError as e:
            raise ValueError(f"cannot reach {self.url}: {e}") from None
        if models.status_code != 200:
            raise ValueError(f"{self.url}/v1/models answered {models.status_code}: {models.text[:200]}")
        card = models.json()["data"][0]
        self.model = card["id"]
        self.label = f"{self.model} ({card.get('dtype')}) at {self.url}"
        self.sampling = asdict(sampling)  # the request's fields, by the same names

    def answer(self, history: list[dict[str, str]]) -> str:
        import json

        body = {"model": self.model, "messages": history, "stream": True, **self.sampling}
        text: list[str] = []
        with self.http.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                err = json.loads(r.read() or b"{}").get("error", {})
                if err.get("code") == "context_length_exceeded":
                    raise TooLong()
                raise ValueError(f"the server answered {r.status_code}: {err.get('message', r.text[:200])}")
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    raise ValueError(f"the server stopped the answer: {obj['error'].get('message')}")
                for ch in obj.get("choices", []):
                    piece = ch.get("delta", {}).get("content") or ""
                    text.append(piece)
                    sys.stdout.write(piece)
                    sys.stdout.flush()
        sys.stdout.write("\n")
        return "".join(text)


class ChatBackend(Protocol):
    """Where a chat's answers come from: ``answer`` streams the next one (raising TooLong when the
    history no longer fits, ValueError with what went wrong)."""

    label: str

    def answer(self, history: list[dict[str, str]]) -> str: ...


def chat_loop(backend: ChatBackend, system: str | None) -> int:
    """Interactive chat: the whole history is re-sent each turn; the prefix cache makes that cheap."""
    history: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    first = len(history)
    print(f"tripod chat with {backend.label}; empty line or Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if not line.strip():
            return 0
        history.append({"role": "user", "content": line})
        answer = None
        while answer is None:
            try:
                answer = backend.answer(history)
            except TooLong:
                # Drop the oldest turn (keeping a system message) while the history overflows.
                if len(history) - first > 1:
                    del history[first : first + 2]
                    continue
                print("tripod: this message alone is longer than the context; shorten it", file=sys.stderr)
                break
            except ValueError as e:
                print(f"tripod: {e}", file=sys.stderr)
                break
        if answer is None:
            history.pop()
        else:
            history.append({"role": "assistant", "content": answer})
