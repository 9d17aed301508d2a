"""``LLMClient``: what ``chains.llm(model=...)`` gives a chainlet — an async client to one model of
an OpenAI-compatible endpoint (the chain's router under ``tripod chains serve``), with
structured outputs and streaming.

    text = await self.llm.chat("Write a haiku", max_tokens=64)
    verdict = await self.llm.chat(messages, response_model=Verdict)      # json_schema, parsed
    async for piece in self.llm.stream(messages): ...                    # text deltas
    body = await self.llm.create(messages=[...], logprobs=True)          # the raw answer

Cancelling a call (a timeout, the chain's caller leaving) closes its connection, and the model
server aborts the request and frees its memory.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel

from tripod import tracing
from tripod.chains.errors import LLMError, retryable_status

M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where a model is served: an OpenAI-compatible base URL (``http://host:port`` or ``…/v1``),
    and the model id to send (default: the chain's name for it)."""

    url: str
    model: str | None = None
    api_key: str | None = None

    @property
    def base_url(self) -> str:
        url = self.url.rstrip("/")
        return url if url.endswith("/v1") else url + "/v1"


class ClientPool:
    """One ``httpx.AsyncClient`` per event loop (a client's connections belong to the loop that made them)."""

    def __init__(self, timeout: float | None) -> None:
        self.timeout = timeout  # None: no read limit (the caller's timeout_s bounds a call)
        self._by_loop: dict[int, tuple[asyncio.AbstractEventLoop, httpx.AsyncClient]] = {}

    def get(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        entry = self._by_loop.get(id(loop))
        if entry is None or entry[0] is not loop or entry[1].is_closed:
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
            client = httpx.AsyncClient(timeout=httpx.Timeout(self.timeout, connect=10.0), limits=limits)
            self._by_loop = {k: v for k, v in self._by_loop.items() if not v[0].is_closed()}
            self._by_loop[id(loop)] = (loop, client)
            return client
        return entry[1]

    async def aclose(self) -> None:
        loop = asyncio.get_running_loop()
        entry = self._by_loop.pop(id(loop), None)
        if entry is not None:
            await entry[1].aclose()


def _messages(messages: str | list[dict[str, Any]], system: str | None) -> list[dict[str, Any]]:
    msgs = [{"role": "user", "content": messages}] if isinstance(messages, str) else list(messages)
    return ([{"role": "system", "content": system}] if system else []) + msgs


def schema_format(model: type[BaseModel]) -> dict[str, Any]:
    """``response_format`` asking for JSON that matches a pydantic model."""
    return {"type": "json_schema", "json_schema": {"name": model.__name__, "schema": model.model_json_schema(),
                                                   "strict": True}}


class LLMClient:
    """An async client to one model. ``defaults`` (from ``chains.llm``) go into every request;
    keyword arguments of a call override them and may be any field of the OpenAI API (and
    tripod's extensions: ``regex``, ``choice``, ``ebnf``, ``ignore_eos``, ...)."""

    def __init__(self, endpoint: Endpoint, name: str, defaults: dict[str, Any] | None = None,
                 clients: ClientPool | None = None, timeout: float = 600.0) -> None:
        self.endpoint = endpoint
        self.name = name  # the chain's name for the model
        self.model = endpoint.model or name  # the id sent in requests
        self.defaults = dict(defaults or {})
        self._clients = clients or ClientPool(timeout)

    def __repr__(self) -> str:
        return f"<LLMClient {self.name} at {self.endpoint.base_url}>"

    def _headers(self) -> dict[str, str]:
        headers = {"Authorization": f"Bearer {self.endpoint.api_key}"} if self.endpoint.api_key else {}
        return tracing.inject(headers) if tracing.ACTIVE else headers  # the call continues the current trace

    def _body(self, extra: dict[str, Any]) -> dict[str, Any]:
        return {"model": self.model, **self.defaults, **{k: v for k, v in extra.items() if v is not None}}

    def _error(self, e: Exception | None = None, status: int | None = None, text: str = "") -> LLMError:
        if e is not None:
            return LLMError(self.name, f"{type(e).__name__} talking to {self.endpoint.base_url}: {e}", None, True)
        try:
            msg = json.loads(text)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            msg = text[:300]
        assert status is not None
        return LLMError(self.name, f"answered {status}: {msg}", status, retryable_status(status))

    async def create(self, path: str = "/chat/completions", **body: Any) -> dict[str, Any]:
        """POST one request (not streamed); the answer's JSON."""
        client = self._clients.get()
        try:
            r = await client.post(self.endpoint.base_url + path, json=self._body(body), headers=self._headers())
        except httpx.HTTPError as e:
            raise self._error(e) from e
        if r.status_code != 200:
            raise self._error(status=r.status_code, text=r.text)
        return dict(r.json())

    async def chat(self, messages: str | list[dict[str, Any]], *, system: str | None = None,
                   response_model: type[M] | None = None, **params: Any) -> Any:
        """One chat turn; its text, or with ``response_model`` (a pydantic model) the parsed object
        (the model is constrained to its JSON schema)."""
        if response_model is not None:
            params["response_format"] = schema_format(response_model)
        body = await self.create(messages=_messages(messages, system), **params)
        text = body["choices"][0]["message"].get("content") or ""
        if response_model is None:
            return text
        try:
            return response_model.model_validate_json(text)
        except ValueError as e:
            raise LLMError(self.name, f"answered JSON that does not match {response_model.__name__}: {e}") from e

    async def complete(self, prompt: str, **params: Any) -> str:
        """A plain completion's text."""
        body = await self.create("/completions", prompt=prompt, **params)
        return str(body["choices"][0].get("text") or "")

    async def stream(self, messages: str | list[dict[str, Any]], *, system: str | None = None,
                     **params: Any) -> AsyncIterator[str]:
        """A chat turn streamed: its text deltas as they are generated."""
        async for chunk in self.stream_events(messages=_messages(messages, system), **params):
            for ch in chunk.get("choices") or []:
                piece = (ch.get("delta") or {}).get("content")
                if piece:
                    yield piece

    async def stream_events(self, path: str = "/chat/completions", **body: Any) -> AsyncIterator[dict[str, Any]]:
        """The raw streamed chunks (JSON objects) of one request."""
        client = self._clients.get()
        req = client.build_request("POST", self.endpoint.base_url + path, json={**self._body(body), "stream": True},
                                   headers=self._headers())
        try:
            resp = await client.send(req, stream=True)
        except httpx.HTTPError as e:
            raise self._error(e) from e
        try:
            if resp.status_code != 200:
                raise self._error(status=resp.status_code, text=(await resp.aread()).decode(errors="replace"))
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    return
                obj = json.loads(data)
                if "error" in obj:
                    raise LLMError(self.name, f"the stream ended with an error: {obj['error'].get('message')}",
                                   None, False)
                yield obj
        except httpx.HTTPError as e:
            raise self._error(e) from e
        finally:
            # NOTE: closing a response that was not read to its end drops the connection: the
            # model server sees the client leave and aborts the request.
            await resp.aclose()

    def openai(self) -> Any:
        """An ``openai.AsyncOpenAI`` client for the same endpoint (needs the ``openai`` package)."""
        import openai

        return openai.AsyncOpenAI(base_url=self.endpoint.base_url, api_key=self.endpoint.api_key or "unused")

    async def aclose(self) -> None:
        await self._clients.aclose()
