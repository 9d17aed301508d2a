"""Errors a caller can cause (4xx) or that the server reports (5xx): ``APIError``, and its body
and response in the shape of the API that was called (OpenAI's everywhere, Anthropic's on
``/v1/messages``).

Every route raises ``APIError``; ``app.build_app`` answers it with ``error_response``, which picks
the shape by path. A stream whose status line has gone sends the same body as an event.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

# Anthropic's error types by HTTP status (its API documents these; others map to api_error).
_ANTHROPIC_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
    429: "rate_limit_error", 529: "overloaded_error",
}


class APIError(Exception):
    """An error the caller can fix (4xx) or that the server reports (5xx), OpenAI-shaped."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        type: str = "invalid_request_error",
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict[str, Any]:
        """The same error in Anthropic's shape (``/v1/messages``)."""
        return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(self.status, "api_error"),
                                           "message": self.message}}


def anthropic_path(path: str) -> bool:
    """Whether ``path`` is the Anthropic surface's (its errors take Anthropic's shape)."""
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def error_response(e: APIError, path: str) -> JSONResponse:
    """``e`` answered in the shape of the API ``path`` belongs to."""
    body = e.anthropic_body() if anthropic_path(path) else e.body()
    return JSONResponse(body, status_code=e.status, headers=e.headers)


def too_large(limit: int) -> APIError:
    """The 413 of a request body past ``limit`` bytes."""
    return APIError(413, f"the request body is larger than {limit} bytes; send less (smaller or fewer images, or "
                    "images by URL), or start the server with a larger --max-body-bytes", code="body_too_large")
