"""The programming model: ``Chainlet``, ``depends``, ``entrypoint``, ``llm``, ``Model``, the chain
context chainlets are built in (``Runtime``, ``current``), and the graph of a chain. The typed
boundary of each chainlet (``Signature``) is ``tripod.chains.signature``; calling one (handles,
retries, timeouts) is ``tripod.chains.runtime``.

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

import contextvars
import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from tripod.chains.errors import ChainError
from tripod.chains.llm_client import LLMClient
from tripod.chains.metrics import ChainMetrics
from tripod.chains.signature import Signature

T = TypeVar("T")
C = TypeVar("C", bound=type)


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



# --------------------------------------------------------------------------- the chain context
class Callee(Protocol):
    """A dependency as its caller holds it at run time (``tripod.chains.runtime.Handle``):
    ``run`` takes the callee's parameters."""

    def run(self, *args: Any, **kwargs: Any) -> Any: ...


class Runtime:
    """A chain context (``run_local``, or a served replica's): while it is active, building a
    chainlet turns its ``depends`` markers into handles and its ``chains.llm`` into clients.

    NOTE: it lives beside ``Chainlet`` because building one reads it; the handles it gives out
    (``tripod.chains.runtime``) import this module, never the other way round."""

    metrics: ChainMetrics

    def dependency(self, dep: Dependency, caller: type[Chainlet]) -> Callee:
        raise NotImplementedError

    def llm(self, spec: LLMSpec, caller: type[Chainlet]) -> LLMClient:
        raise NotImplementedError

    def activate(self) -> contextvars.Token[Runtime | None]:
        return _current.set(self)

    @staticmethod
    def deactivate(token: contextvars.Token[Runtime | None]) -> None:
        _current.reset(token)


_current: contextvars.ContextVar[Runtime | None] = contextvars.ContextVar("tripod_chain_runtime", default=None)


def current() -> Runtime | None:
    """The chain context chainlets are being built in (``run_local``, or a served replica's)."""
    return _current.get()


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
    @functools.wraps(init or Chainlet.__init__)
    def __init__(self: Chainlet, *args: Any, **kwargs: Any) -> None:
        own = type(self).__dict__.get("__init__") is __init__
        if own:  # the most derived wrapper does the binding once
            ctx = current()
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
