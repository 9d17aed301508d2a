"""Loading a chain from its file: the module, its entrypoint, its graph and its declared models."""

from __future__ import annotations

import importlib.util
import inspect
import re
import sys
from pathlib import Path
from types import ModuleType

from tripod.chains.core import Chainlet, Graph, Model
from tripod.chains.errors import ChainError


def load_file(path: str | Path) -> ModuleType:
    """Import a chain's Python file (its folder goes on ``sys.path`` for its own imports)."""
    p = Path(path).resolve()
    if not p.is_file():
        raise FileNotFoundError(f"no chain file at {path}")
    name = "tripod_chain_" + re.sub(r"\W", "_", p.stem)
    if name in sys.modules and getattr(sys.modules[name], "__file__", None) == str(p):
        return sys.modules[name]
    folder = str(p.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location(name, p)
    if spec is None or spec.loader is None:
        raise ChainError(f"{path} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # NOTE: before exec: pydantic and dataclasses look their module up
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def _chainlets(module: ModuleType) -> list[type[Chainlet]]:
    return [v for v in vars(module).values()
            if inspect.isclass(v) and issubclass(v, Chainlet) and v is not Chainlet]


def find_entrypoint(module: ModuleType, name: str | None = None) -> type[Chainlet]:
    classes = _chainlets(module)
    if name:
        for c in classes:
            if c.__name__ == name:
                return c
        raise ChainError(f"{module.__file__} has no chainlet named {name!r} (it has: "
                         f"{', '.join(sorted(c.__name__ for c in classes)) or 'none'})")
    marked = [c for c in classes if c.__dict__.get("__tripod_entrypoint__") is not None]
    if len(marked) == 1:
        return marked[0]
    if not marked:
        raise ChainError(f"{module.__file__} marks no chainlet with @chains.entrypoint; mark one or pass "
                         "--entrypoint NAME")
    raise ChainError(f"{module.__file__} marks several entrypoints ({', '.join(c.__name__ for c in marked)}); "
                     "pass --entrypoint NAME")


def declared_models(module: ModuleType) -> dict[str, Model]:
    """The module's ``chains.Model`` declarations (module-level names), by model name."""
    out: dict[str, Model] = {}
    for v in vars(module).values():
        if isinstance(v, Model):
            out[v.name] = v
    return out


def load_chain(path: str | Path, entrypoint: str | None = None) -> tuple[ModuleType, Graph]:
    module = load_file(path)
    return module, Graph.build(find_entrypoint(module, entrypoint))
