"""Request bodies, as every API surface reads them: at most ``--max-body-bytes`` (413 past it),
then parsed into a strict request model (``parse``: a 400 naming the first bad field).

``StrictModel`` is the base of every surface's request models: types checked strictly (``"5"`` is
not a number, ``true`` is not 1), unknown fields ignored (clients sending newer fields keep
working).
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tripod import asgi
from tripod.server.errors import APIError, too_large


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body, at most ``limit`` bytes (413 past it)."""
    try:
        return await asgi.read_body(request, limit)
    except asgi.BodyTooLarge:
        raise too_large(limit) from None


class StrictModel(BaseModel):
    """The base of every request model: strict types, unknown fields ignored."""

    model_config = ConfigDict(strict=True, extra="ignore")


def one_of(*values: str) -> Any:
    """A string field documented (OpenAPI) as one of ``values``; the route checks it itself, with a
    message that says what to send."""
    return Field(json_schema_extra={"enum": list(values)})


def parse(cls: type[BaseModel], raw: bytes) -> Any:
    """Bytes → request model, or an ``APIError`` naming the first bad field."""
    if not raw.strip():
        raise APIError(400, "the request body is empty; send a JSON object")
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, not {type(data).__name__}")
    try:
        return cls.model_validate(data, strict=True)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"] if not isinstance(x, str) or not _is_type_tag(x))
        if err["type"] == "missing":
            raise APIError(400, f"'{loc}' is required", param=loc) from None
        got = err.get("input")
        shown = json.dumps(got)[:80] if _jsonable(got) else repr(got)[:80]
        raise APIError(400, f"'{loc}': {err['msg']} (got {shown})", param=loc) from None


def _is_type_tag(x: str) -> bool:
    # pydantic puts union member names into locations ("str", "list[int]", "function-after[...]").
    return x in ("str", "int", "float", "bool") or "[" in x


def _jsonable(x: Any) -> bool:
    try:
        json.dumps(x)
        return True
    except (TypeError, ValueError):
        return False
