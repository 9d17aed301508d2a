"""The errors of a chain, the same locally and over the wire.

A call to a chainlet fails with a ``ChainletError`` that names the chainlet (and the path of calls
that led to it) and the cause. Over HTTP it travels as an OpenAI-style error body with the extra
fields ``chainlet``, ``path`` and ``retryable``, so a caller one hop up can rebuild it exactly
(the body is ``tripod.protocol.chains.ErrorBody``).
"""

from __future__ import annotations

from typing import Any

import msgspec

from tripod.protocol.chains import ErrorBody, ErrorInfo, FieldError, decode, encode

# Status of an answer → whether a caller may try again (on another replica).
_RETRYABLE_STATUS = frozenset({429, 500, 502, 503, 504})


class ChainError(Exception):
    """A mistake in how a chain is written or run (no call was made)."""


class ChainletError(Exception):
    """A call to a chainlet failed.

    ``chainlet``: the chainlet the caller called. ``path``: the chain of calls down to where the
    failure began (``["Writer", "Critic"]``: Writer's call to Critic failed). ``code``:
    ``invalid_arguments`` (400), ``invalid_output``, ``chainlet_error`` (its code raised),
    ``timeout``, ``unavailable`` (its process was lost, or none is running), ``llm_error``,
    ``cancelled``. ``retryable``: whether calling again may succeed; validation errors never are.
    ``errors``: pydantic's list of field errors for validation failures.
    """

    def __init__(self, chainlet: str, message: str, *, code: str = "chainlet_error", status: int = 500,
                 retryable: bool = False, path: list[str] | None = None, param: str | None = None,
                 errors: list[FieldError] | None = None) -> None:
        self.chainlet = chainlet
        self.path = list(path) if path else [chainlet]
        self.code = code
        self.status = status
        self.retryable = retryable
        self.param = param
        self.errors = errors
        self.detail = message
        super().__init__(f"{' → '.join(self.path)}: {message}")

    @property
    def message(self) -> str:
        return str(self)

    def envelope(self) -> ErrorBody:
        """The error as its callers receive it."""
        kind = "invalid_request_error" if 400 <= self.status < 500 and self.status != 429 else "server_error"
        return ErrorBody(ErrorInfo(message=self.message, type=kind, param=self.param, code=self.code,
                                   chainlet=self.chainlet, path=self.path, retryable=self.retryable,
                                   detail=self.detail, status=self.status,
                                   errors=self.errors if self.errors is not None else msgspec.UNSET))

    def body(self) -> dict[str, Any]:
        """The envelope as plain JSON-shaped data."""
        return msgspec.to_builtins(self.envelope())  # type: ignore[no-any-return]

    def to_json(self) -> bytes:
        return encode(self.envelope())

    @classmethod
    def from_body(cls, chainlet: str, status: int, raw: bytes | str) -> ChainletError:
        """Rebuild the error a chainlet answered with (or describe an answer that is not one)."""
        try:
            err = decode(raw, ErrorBody).error
        except msgspec.DecodeError:
            text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
            return cls(chainlet, f"answered {status}: {text[:300]}", code="chainlet_error", status=status,
                       retryable=status in _RETRYABLE_STATUS)
        status = err.status or status
        retryable = err.retryable if isinstance(err.retryable, bool) else status in _RETRYABLE_STATUS
        errors = err.errors if isinstance(err.errors, list) else None
        return cls(err.chainlet or chainlet, err.detail or err.message or str(status),
                   code=err.code or "chainlet_error", status=status, retryable=retryable,
                   path=err.path or [chainlet], param=err.param, errors=errors)

    def after(self, attempts: int) -> ChainletError:
        """The same error, saying how many attempts were made."""
        if attempts <= 1:
            return self
        return ChainletError(self.chainlet, f"{self.detail} (after {attempts} attempts)", code=self.code,
                             status=self.status, retryable=self.retryable, path=self.path, param=self.param,
                             errors=self.errors)

    def within(self, caller: str) -> ChainletError:
        """This error as the caller's own failure (one level up the path)."""
        status = 504 if self.code == "timeout" else 500
        return ChainletError(caller, self.detail, code=self.code if self.code != "invalid_arguments"
                             else "dependency_invalid_arguments", status=status, retryable=self.retryable,
                             path=[caller, *self.path], param=self.param, errors=self.errors)


class LLMError(Exception):
    """An LLM request failed. ``retryable``: a lost or overloaded model server (5xx, 429, transport),
    not a refused request (4xx)."""

    def __init__(self, model: str, message: str, status: int | None = None, retryable: bool = False) -> None:
        super().__init__(f"model {model!r}: {message}")
        self.model = model
        self.status = status
        self.retryable = retryable


def retryable_status(status: int) -> bool:
    return status in _RETRYABLE_STATUS
