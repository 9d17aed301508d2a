"""The typed boundary of a chainlet: ``Signature``, the contract of its ``run``.

Its parameters and return annotation are the contract: every call validates the arguments against
the parameters and the answer against the return type with pydantic, and what crosses the boundary
is JSON-shaped data inside the envelopes of ``tripod.protocol.chains``, the same whether the callee
runs in this process (``run_local``) or in another (``tripod chains serve``).
"""

from __future__ import annotations

import collections.abc
import functools
import inspect
import typing
from collections.abc import Callable
from typing import Any, get_args, get_origin

import msgspec
import pydantic
from pydantic import BaseModel, ConfigDict, TypeAdapter
from pydantic_core import PydanticSerializationError, to_jsonable_python

from tripod.chains.errors import ChainError, ChainletError
from tripod.protocol.chains import ChainCall, FieldError, call_from_json

_STREAM_ORIGINS = (collections.abc.AsyncIterator, collections.abc.AsyncIterable, collections.abc.AsyncGenerator)


def _field_name(loc: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in loc)


def validation_error(chainlet: str, what: str, e: pydantic.ValidationError, status: int,
                     code: str) -> ChainletError:
    """A pydantic failure as the ``ChainletError`` its caller gets: every field named, the first as ``param``."""
    errs = e.errors(include_url=False, include_context=False, include_input=False)
    parts = [f"{_field_name(err['loc']) or '(value)'}: {err['msg']}" for err in errs]
    param = _field_name(errs[0]["loc"]) if errs and errs[0]["loc"] else None
    return ChainletError(chainlet, f"{what}: " + "; ".join(parts), code=code, status=status, retryable=False,
                         param=param, errors=[FieldError(list(err["loc"]), err["msg"], err["type"]) for err in errs])


class Signature:
    """The contract of one chainlet's ``run``: its parameters (a pydantic model that forbids extra
    fields), its return or item type, and whether it streams. Type hints are resolved on first use,
    so a model defined further down the module is fine.

    NOTE: it reads only ``cls.run`` and ``cls.__name__``, so it takes any class: ``Chainlet``
    (``tripod.chains.core``) builds one per subclass, and this module never imports it."""

    def __init__(self, cls: type) -> None:
        self.cls = cls
        self.name = cls.__name__
        fn = cls.__dict__.get("run") or getattr(cls, "run", None)
        if fn is None or not callable(fn):
            raise ChainError(f"{cls.__name__} needs a `run` method")
        self.fn: Callable[..., Any] = fn
        if inspect.isgeneratorfunction(fn):
            raise ChainError(f"{cls.__name__}.run is a plain generator; make it `async def` to stream")
        self.streaming = inspect.isasyncgenfunction(fn)
        self.is_async = inspect.iscoroutinefunction(fn)
        params = list(inspect.signature(fn).parameters.values())[1:]  # without self
        for p in params:
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                raise ChainError(f"{cls.__name__}.run: *args/**kwargs cannot be typed at a chain boundary; "
                                 f"name every parameter ({p.name})")
        self.params = params
        self.names = [p.name for p in params]

    @functools.cached_property
    def _hints(self) -> dict[str, Any]:
        try:
            return typing.get_type_hints(self.fn, include_extras=True)
        except Exception as e:  # a NameError in an annotation, mostly
            raise ChainError(f"{self.name}.run: cannot resolve its type annotations ({e})") from e

    @functools.cached_property
    def input_model(self) -> type[BaseModel]:
        fields: dict[str, Any] = {}
        for p in self.params:
            ann = self._hints.get(p.name, Any)
            fields[p.name] = (ann, ... if p.default is inspect.Parameter.empty else p.default)
        return pydantic.create_model(  # type: ignore[call-overload, no-any-return]
            f"{self.name}Input", __config__=ConfigDict(extra="forbid", arbitrary_types_allowed=True), **fields)

    @functools.cached_property
    def output_type(self) -> Any:
        ret = self._hints.get("return", Any)
        if self.streaming:
            if get_origin(ret) in _STREAM_ORIGINS:
                args = get_args(ret)
                return args[0] if args else Any
            return Any if ret is Any or "return" not in self._hints else ret
        if get_origin(ret) in _STREAM_ORIGINS:
            raise ChainError(f"{self.name}.run is annotated to return {ret} but is not an async generator; "
                             "write it with `yield` to stream")
        return type(None) if ret is None else ret

    @functools.cached_property
    def output_adapter(self) -> TypeAdapter[Any]:
        return TypeAdapter(self.output_type)

    def encode_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> ChainCall:
        """A caller's arguments as the call sent to the callee (JSON-shaped values)."""
        if len(args) > len(self.names):
            raise TypeError(f"{self.name}.run takes {len(self.names)} arguments ({len(args)} given)")
        payload = dict(zip(self.names, args, strict=False))
        for k, v in kwargs.items():
            if k in payload:
                raise TypeError(f"{self.name}.run got multiple values for argument {k!r}")
            payload[k] = v
        return ChainCall(to_jsonable(payload))

    def parse_args(self, payload: Any) -> dict[str, Any]:
        """The callee's side, from a parsed JSON body: validated into typed arguments (400 on failure)."""
        try:
            call = call_from_json(payload)
        except msgspec.ValidationError:
            raise ChainletError(self.name, "the arguments must be a JSON object of the run parameters by name",
                                code="invalid_arguments", status=400) from None
        return self.parse_call(call)

    def parse_call(self, call: ChainCall) -> dict[str, Any]:
        """The callee's side: the call's arguments validated into typed ones (400 on failure)."""
        try:
            m = self.input_model.model_validate(call.args)
        except pydantic.ValidationError as e:
            raise validation_error(self.name, "invalid arguments", e, 400, "invalid_arguments") from None
        return {n: getattr(m, n) for n in self.names}

    def dump_output(self, value: Any) -> Any:
        """The callee's side: its return value (or one streamed item) checked against its
        annotation and turned into JSON-shaped data."""
        try:
            checked = self.output_adapter.validate_python(value)
            return self.output_adapter.dump_python(checked, mode="json")
        except pydantic.ValidationError as e:
            what = "streamed an item" if self.streaming else "returned a value"
            raise validation_error(self.name, f"{what} that does not match its annotation "
                                   f"{_type_name(self.output_type)}", e, 500, "invalid_output") from None
        except PydanticSerializationError as e:
            raise ChainletError(self.name, f"returned a value that cannot be sent as JSON: {e}",
                                code="invalid_output") from None

    def parse_output(self, data: Any) -> Any:
        """The caller's side: JSON-shaped data back into the typed value."""
        try:
            return self.output_adapter.validate_python(data)
        except pydantic.ValidationError as e:
            raise validation_error(self.name, "answered a value that does not match its annotation", e, 500,
                                   "invalid_output") from None

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"streaming": self.streaming, "input_schema": self.input_model.model_json_schema()}
        try:
            out["output_schema"] = self.output_adapter.json_schema()
        except pydantic.PydanticUserError:
            out["output_schema"] = None
        return out


def _type_name(t: Any) -> str:
    return getattr(t, "__name__", None) or str(t)


def to_jsonable(value: Any) -> Any:
    try:
        return to_jsonable_python(value)
    except PydanticSerializationError as e:
        raise TypeError(f"an argument cannot be sent as JSON: {e}") from None
