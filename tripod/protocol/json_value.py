"""JSON-shaped data, named: ``JSONValue`` and ``JSONObject``.

A message field typed with them holds JSON whose shape is not tripod's to fix: the user's own (a
chain's arguments and answers, the JSON schemas of a chainlet's contract, the request defaults of
a ``chains.llm``), typed by the user's annotations on the side that reads it. The builtins view of
a typed message (an ``as_json()``) is a ``JSONObject`` too.

NOTE: the type checker sees the recursive alias; at run time ``JSONValue`` is ``Any``, because
msgspec (on Python 3.11) cannot resolve a recursive alias. So a message decodes such a field
without checking inside it: the user's annotations (pydantic, ``tripod.chains.signature``) do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeAlias

if TYPE_CHECKING:
    JSONValue: TypeAlias = "bool | int | float | str | list[JSONValue] | dict[str, JSONValue] | None"
    JSONObject: TypeAlias = "dict[str, JSONValue]"
else:
    JSONValue = Any
    JSONObject = dict[str, Any]
