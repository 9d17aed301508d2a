"""ASGI and uvicorn pieces shared by the server and the router (which never import each other)."""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator, Callable, Mapping
from types import FrameType

import uvicorn
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


class DrainingServer(uvicorn.Server):
    """uvicorn with draining: every SIGTERM/SIGINT first calls ``on_signal`` (the app marks itself
    draining: new requests get 503 + Retry-After), while uvicorn closes the port and waits for the
    answers in flight up to its graceful-shutdown timeout."""

    def __init__(self, config: uvicorn.Config, on_signal: Callable[[signal.Signals], None]) -> None:
        super().__init__(config)
        self.on_signal = on_signal

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.on_signal(signal.Signals(sig))
        super().handle_exit(sig, frame)
        # NOTE: uvicorn re-raises captured signals after shutdown (exit 143 for SIGTERM); a clean
        # drain is a clean exit, so the exit code is ours to set.
        self._captured_signals.clear()
