"""The programming model: ``Chainlet``, ``depends``, ``entrypoint``, ``llm``, ``Model``, and the
typed boundary of each chainlet (``Signature``).

A chainlet is a class with one ``run`` method (``async def``, an async generator for a streaming
chainlet, or a plain ``def``, run in a thread). Its parameters and return annotation are the
contract: every call validates the arguments against the parameters and the answer against the
return type with pydantic, and what crosses the boundary is JSON-shaped data, the same whether the
callee runs in this process (``run_local``) or in another (``tripod chains serve``).

Dependencies are declared as defaults of ``__init__``: ``critic=chains.depends(Critic, ...)``.
Constructing a chainlet inside a chain context (``run_local`` or a served replica) replaces each
such default with a handle whose ``run`` has the callee's signature and does the retries, the
timeout and the validation. LLMs are class attributes ``llm = chains.llm(model="judge")``; an
instance built in a context gets an ``LLMClient`` for that model in their place.
"""

from __future__ import annotations

import collections.abc
import functools
import inspect
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar, get_args, get_origin

import pydantic
from pydantic import BaseModel, ConfigDict, TypeAdapter
from pydantic_core import PydanticSerializationError

from tripod.chains.errors import ChainError, ChainletError

T = TypeVar("T")
C = TypeVar("C", bound=type)

_STREAM_ORIGINS = (collections.abc.AsyncIterator, collections.abc.AsyncIterable, collections.abc.AsyncGenerator)


# --------------------------------------------------------------------------- declarations
@dataclass(frozen=True, slots=True)
class Dependency:
    """``chains.depends(Cls, ...)``: a marker used as an ``__init__`` default."""

    cls: type[Chainlet]
    retries: int = 0
    timeout_s: float | None = None
    replicas: int = 1
    backoff_s: float = 0.1

    def __post_init__(self) -> None:
        if not (isinstance(self.cls, type) and issubclass(self.cls, Chainlet)):
            raise ChainError(f"chains.depends() needs a Chainlet subclass (got {self.cls!r})")
        if self.retries < 0:
            raise ChainError(f"retries must be >= 0 (got {self.retries})")
        if self.timeout_s is not None and self.timeout_s <= 0:
            raise ChainError(f"timeout_s must be > 0 (got {self.timeout_s})")
        if self.replicas < 1:
            raise ChainError(f"replicas must be >= 1 (got {self.replicas})")
        if self.backoff_s < 0:
            raise ChainError(f"backoff_s must be >= 0 (got {self.backoff_s})")

    def __repr__(self) -> str:
        return f"depends({self.cls.__name__}, retries={self.retries}, timeout_s={self.timeout_s})"


def depends(cls: type[T], *, retries: int = 0, timeout_s: float | None = None, replicas: int = 1,
            backoff_s: float = 0.1) -> Any:
    """Declare a dependency on chainlet ``cls`` (as an ``__init__`` default).

    ``retries``: further attempts after a retryable failure (a lost chainlet process, a 5xx, a
    timeout; never a validation error), after ``backoff_s`` doubling per attempt. ``timeout_s``:
    the limit of each attempt; past it the callee's work is cancelled. ``replicas``: how many
    processes ``tripod chains serve`` runs for ``cls`` (the largest any caller asks for).
    """
    return Dependency(cls, retries, timeout_s, replicas, backoff_s)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class Model:
    """A model a chain uses, by name. Served by a tripod fleet under ``tripod chains serve``.

    ``path``: a .gguf file or HF folder (None: the embedded model). ``replicas`` (or
    ``min_replicas``/``max_replicas``: autoscaled): the fleet's size. ``args``: more ``tripod
    serve`` options for its replicas. ``url``: an OpenAI-compatible server that already serves the
    model (no fleet is started; requests still go through the chain's router).
    Declare it at module level (``JUDGE = chains.Model("judge")``) so ``tripod chains serve`` finds it.
    """

    name: str
    path: str | None = None
    replicas: int = 1
    min_replicas: int | None = None
    max_replicas: int | None = None
    args: tuple[str, ...] = ()
    url: str | None = None

    def __post_init__(self) -> None:
        if not self.name or "=" in self.name or "/" in self.name:
            raise ChainError(f"a model name must be non-empty, without '=' or '/' (got {self.name!r})")
        if self.replicas < 1:
            raise ChainError(f"replicas must be >= 1 (got {self.replicas})")


@dataclass(frozen=True)
class LLMSpec:
    """``chains.llm(model=..., **defaults)``: a class attribute; instances get an ``LLMClient``."""

    model: str
    defaults: dict[str, Any] = field(default_factory=dict)
    declared: Model | None = None
    attr: str = ""

    def __set_name__(self, owner: type, name: str) -> None:
        object.__setattr__(self, "attr", name)

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        if instance is None:
            return self
        raise ChainError(f"{type(instance).__name__}.{self.attr} (model {self.model!r}) is bound when the chainlet "
                         "is built inside a chain context: build it inside `with chains.run_local(...)`, or "
                         "serve the chain with `tripod chains serve`")


def llm(model: str | Model, **sampling_defaults: Any) -> Any:
    """An async, OpenAI-compatible client to the model named ``model`` (a class attribute of a
    chainlet). ``sampling_defaults`` (``temperature``, ``max_tokens``, ...) go into every request
    unless a call overrides them."""
    if isinstance(model, Model):
        return LLMSpec(model.name, dict(sampling_defaults), model)
    if not isinstance(model, str) or not model:
        raise ChainError(f"chains.llm(model=...) needs a model name or a chains.Model (got {model!r})")
    return LLMSpec(model, dict(sampling_defaults))


@dataclass(frozen=True, slots=True)
class EntrypointOptions:
    retries: int = 0
    timeout_s: float | None = None
    replicas: int = 1


def entrypoint(cls: Any = None, *, retries: int = 0, timeout_s: float | None = None, replicas: int = 1) -> Any:
    """Mark the chainlet a chain starts from (``@chains.entrypoint`` or ``@chains.entrypoint(replicas=2)``).
    ``retries``/``timeout_s`` apply to the server's call of it, as ``depends`` does for other edges."""

    def mark(c: Any) -> Any:
        if not (isinstance(c, type) and issubclass(c, Chainlet)):
            raise ChainError(f"@chains.entrypoint goes on a Chainlet subclass (got {c!r})")
        Dependency(c, retries, timeout_s, replicas)  # validates the numbers
        c.__tripod_entrypoint__ = EntrypointOptions(retries, timeout_s, replicas)
        return c

    return mark(cls) if cls is not None else mark


# --------------------------------------------------------------------------- the typed boundary
def _field_name(loc: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in loc)


def validation_error(chainlet: str, what: str, e: pydantic.ValidationError, status: int,
                     code: str) -> ChainletError:
    errs = e.errors(include_url=False, include_context=False, include_input=False)
    parts = [f"{_field_name(err['loc']) or '(value)'}: {err['msg']}" for err in errs]
    param = _field_name(errs[0]["loc"]) if errs and errs[0]["loc"] else None
    return ChainletError(chainlet, f"{what}: " + "; ".join(parts), code=code, status=status, retryable=False,
                         param=param, errors=[{"loc": list(err["loc"]), "msg": err["msg"], "type": err["type"]}
                                              for err in errs])


class Signature:
    """The contract of one chainlet's ``run``: its parameters (a pydantic model that forbids extra
    fields), its return or item type, and whether it streams. Type hints are resolved on first use,
    so a model defined further down the module is fine."""

    def __init__(self, cls: type[Chainlet]) -> None:
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

    def encode_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """A caller's arguments as the JSON-shaped payload sent to the callee."""
        if len(args) > len(self.names):
            raise TypeError(f"{self.name}.run takes {len(self.names)} arguments ({len(args)} given)")
        payload = dict(zip(self.names, args, strict=False))
        for k, v in kwargs.items():
            if k in payload:
                raise TypeError(f"{self.name}.run got multiple values for argument {k!r}")
            payload[k] = v
        return to_jsonable(payload)

    def parse_args(self, payload: Any) -> dict[str, Any]:
        """The callee's side: the payload validated into typed arguments (400 on failure)."""
        if not isinstance(payload, dict):
            raise ChainletError(self.name, "the arguments must be a JSON object of the run parameters by name",
                                code="invalid_arguments", status=400)
        try:
            m = self.input_model.model_validate(payload)
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
    from pydantic_core import to_jsonable_python

    try:
        return to_jsonable_python(value)
    except PydanticSerializationError as e:
        raise TypeError(f"an argument cannot be sent as JSON: {e}") from None


# --------------------------------------------------------------------------- Chainlet
class Chainlet:
    """One step of a chain. Subclass it and write one ``run`` method with typed parameters and a
    typed return (pydantic models, dataclasses, builtins); make ``run`` an async generator to stream.

    Declare dependencies as ``__init__`` defaults (``chains.depends``) and LLMs as class
    attributes (``chains.llm``). Build chainlets inside a chain context: ``chains.run_local()``
    or, deployed, ``tripod chains serve``, which builds one instance per replica.
    """

    __tripod_signature__: Signature
    __tripod_entrypoint__: EntrypointOptions | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.__tripod_signature__ = Signature(cls)
        cls.__tripod_entrypoint__ = None  # not inherited: each entrypoint is marked itself
        init = cls.__dict__.get("__init__")
        if init is not None and not getattr(init, "__tripod_wrapped__", False):
            cls.__init__ = _wrap_init(cls, init)  # type: ignore[method-assign]
        elif init is None:
            cls.__init__ = _wrap_init(cls, None)  # type: ignore[method-assign]

    def __init__(self) -> None:
        pass

    async def run(self, *args: Any, **kwargs: Any) -> Any:  # pragma: no cover - replaced by subclasses
        raise NotImplementedError


def _wrap_init(cls: type[Chainlet], init: Callable[..., None] | None) -> Callable[..., None]:
    from tripod.chains import runtime as context

    @functools.wraps(init or Chainlet.__init__)
    def __init__(self: Chainlet, *args: Any, **kwargs: Any) -> None:
        own = type(self).__dict__.get("__init__") is __init__
        if own:  # the most derived wrapper does the binding once
            ctx = context.current()
            for name, dep in dependencies_of(type(self)).items():
                if name in kwargs:
                    continue
                if _positional_index(type(self), name) < len(args):
                    continue
                if ctx is None:
                    raise ChainError(
                        f"{type(self).__name__}() builds its dependency {dep.cls.__name__!r} from a chain context: "
                        "build it inside `with chains.run_local():` (or serve the chain with `tripod chains "
                        "serve`), or pass the dependency yourself")
                kwargs[name] = ctx.dependency(dep, type(self))
            if ctx is not None:
                for attr, spec in llms_of(type(self)).items():
                    self.__dict__[attr] = ctx.llm(spec, type(self))
        if init is not None:
            init(self, *args, **kwargs)
        else:
            super(cls, self).__init__(*args, **kwargs)

    __init__.__tripod_wrapped__ = True  # type: ignore[attr-defined]
    __init__.__tripod_original__ = init  # type: ignore[attr-defined]
    return __init__


def _original_init(cls: type) -> Callable[..., Any] | None:
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        orig = getattr(init, "__tripod_original__", init)
        if orig is None:
            continue
        return orig  # type: ignore[no-any-return]
    return None


def _positional_index(cls: type, name: str) -> int:
    init = _original_init(cls)
    if init is None:
        return 10**9
    names = [p.name for p in inspect.signature(init).parameters.values()
             if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][1:]
    return names.index(name) if name in names else 10**9


def dependencies_of(cls: type) -> dict[str, Dependency]:
    """The ``depends`` defaults of ``cls.__init__``, by parameter name."""
    init = _original_init(cls)
    if init is None or init is object.__init__:
        return {}
    return {p.name: p.default for p in inspect.signature(init).parameters.values()
            if isinstance(p.default, Dependency)}


def llms_of(cls: type) -> dict[str, LLMSpec]:
    out: dict[str, LLMSpec] = {}
    for klass in reversed(cls.__mro__):
        for k, v in vars(klass).items():
            if isinstance(v, LLMSpec):
                out[k] = v
    return out


def signature(cls: type[Chainlet]) -> Signature:
    if not (isinstance(cls, type) and issubclass(cls, Chainlet)) or cls is Chainlet:
        raise ChainError(f"{cls!r} is not a Chainlet subclass")
    return cls.__tripod_signature__


def entrypoint_options(cls: type[Chainlet]) -> EntrypointOptions:
    return cls.__dict__.get("__tripod_entrypoint__") or EntrypointOptions()


# --------------------------------------------------------------------------- the graph
@dataclass(slots=True)
class Node:
    """One chainlet of a chain: its class, how many replicas, what it calls and which models."""

    cls: type[Chainlet]
    replicas: int
    deps: dict[str, Dependency]
    llms: dict[str, LLMSpec]

    @property
    def name(self) -> str:
        return self.cls.__name__


@dataclass(slots=True)
class Graph:
    entrypoint: type[Chainlet]
    nodes: dict[str, Node]

    @classmethod
    def build(cls, ep: type[Chainlet]) -> Graph:
        """Walk the dependencies from ``ep``; refuse cycles and two chainlets of one name."""
        nodes: dict[str, Node] = {}
        opts = entrypoint_options(ep)

        def visit(c: type[Chainlet], replicas: int, trail: list[str]) -> None:
            signature(c)
            if c.__name__ in trail:
                raise ChainError(f"the chain has a cycle: {' → '.join([*trail, c.__name__])}")
            node = nodes.get(c.__name__)
            if node is not None:
                if node.cls is not c:
                    raise ChainError(f"two chainlets are named {c.__name__!r} ({node.cls.__module__} and "
                                     f"{c.__module__}); rename one")
                node.replicas = max(node.replicas, replicas)
            else:
                node = nodes[c.__name__] = Node(c, replicas, dependencies_of(c), llms_of(c))
            for dep in node.deps.values():
                visit(dep.cls, dep.replicas, [*trail, c.__name__])

        visit(ep, opts.replicas, [])
        return cls(ep, nodes)

    def models(self) -> dict[str, Model | None]:
        """Every model a chainlet of the graph uses, with its declaration when ``chains.llm`` got one."""
        out: dict[str, Model | None] = {}
        for node in self.nodes.values():
            for spec in node.llms.values():
                out[spec.model] = out.get(spec.model) or spec.declared
        return out
