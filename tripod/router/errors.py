"""The answers the router gives itself: its error bodies (OpenAI's shape, or Anthropic's on
``/v1/messages``), the error event that ends a stream cut part-way, and which replica statuses
mean that no answer has begun (so that another replica may serve the request)."""

from __future__ import annotations

import json

from starlette.responses import Response

# A replica answering one of these has not started an answer: another replica may serve it.
RETRYABLE = frozenset({429, 500, 502, 503, 504, 529})
FULL = frozenset({429, 529})  # a replica at capacity (529: Anthropic's overloaded_error)
# Anthropic's error types by status; other statuses are api_error.
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                    405: "invalid_request_error", 413: "request_too_large", 429: "rate_limit_error",
                    529: "overloaded_error"}


class RouterError(Exception):
    """An answer the router gives itself, as an OpenAI-style error body."""

    def __init__(self, status: int, message: str, code: str, retry_after: int | None = None,
                 anthropic_status: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.retry_after = retry_after
        self.anthropic_status = anthropic_status or status  # e.g. 529 where OpenAI's side says 429

    def response(self, anthropic: bool = False) -> Response:
        """The error in OpenAI's shape, or in Anthropic's (for ``/v1/messages``)."""
        headers = {"Retry-After": str(self.retry_after)} if self.retry_after is not None else None
        if anthropic:
            status = self.anthropic_status
            err = {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(status, "api_error"),
                                              "message": self.message}}
            return Response(json.dumps(err), status_code=status, media_type="application/json", headers=headers)
        kind = "invalid_request_error" if self.status < 500 and self.status != 429 else "server_error"
        body = {"error": {"message": self.message, "type": kind, "param": None, "code": self.code}}
        return Response(json.dumps(body), status_code=self.status, media_type="application/json", headers=headers)


def stream_error(replica: str, why: str, anthropic: bool, continuations: int | None = None,
                 max_retries: int = 0) -> bytes:
    """The error event that ends a stream cut after it had started (not continued).
    ``continuations``: how many were tried, for an answer under failover (None: not under it)."""
    if continuations is None:
        tail = "It was not retried elsewhere, so no part of it is duplicated: send the request again."
    elif continuations >= max_retries:
        tail = (f"It could not be continued elsewhere ({continuations} continuation(s) tried, "
                "--max-retries): send the request again.")
    else:
        tail = "No replica could continue it: send the request again."
    msg = (f"the replica serving this stream ({replica}) failed after the answer had started ({why}); "
           f"the answer is incomplete. {tail}")
    if anthropic:  # Anthropic's stream error event
        err = {"type": "error", "error": {"type": "api_error", "message": msg}}
        return b"event: error\ndata: " + json.dumps(err).encode() + b"\n\n"
    body = {"error": {"message": msg, "type": "server_error", "param": None, "code": "replica_failed"}}
    return b"data: " + json.dumps(body).encode() + b"\n\n"
