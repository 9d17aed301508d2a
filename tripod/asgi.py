"""Small ASGI pieces shared by the server and the router (which never import each other)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send


class ClosingStream(StreamingResponse):
    """A streaming response whose ``on_close`` runs exactly once however the stream ends: finished,
    client gone, or cancelled by a shutdown (the server aborts the request in its engine; the
    router releases the replica's accounting and closes the upstream connection)."""

    def __init__(self, body: AsyncIterator[bytes], on_close: Callable[[], None], media_type: str | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(body, media_type=media_type, headers=headers)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()
