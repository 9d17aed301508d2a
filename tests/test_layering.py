"""The package map's rules, checked on the source (``docs/architecture.md``, "Layers, and where to start reading"; every module: ``docs/reference/modules.md``):
dependencies point down only, no import circle between modules (lazy and type-checking imports
count), the server and the engine meet only through ``tripod.protocol`` (the engine process is
spawned by name), nobody imports another module's private names, modules and functions stay short,
class names are unique, and the modules that cross process edges or run in the router stay free of
torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "tripod"

# package -> the tripod packages it must never import (directly, at any depth of the module).
FORBIDDEN = {
    "protocol": {"engine", "layers", "models", "loader", "kernels", "server", "router", "fleet", "chains", "console",
                 "bench", "memory"},
    "memory": {"engine", "layers", "models", "loader", "server", "router", "fleet", "chains", "console", "bench"},
    "engine": {"server", "router", "fleet", "chains", "console", "bench"},
    "layers": {"engine", "models", "loader", "server", "router", "fleet", "chains", "console", "bench"},
    "models": {"engine", "loader", "server", "router", "fleet", "chains", "console", "bench"},
    "router": {"engine", "layers", "models", "loader", "kernels", "server", "fleet", "chains", "bench"},
    # NOTE: the server spawns the engine process by name (``python -m tripod.engine.process``) and
    # speaks tripod.protocol to it: it imports nothing of the engine (nor what only the engine runs).
    "server": {"engine", "router", "fleet", "chains", "bench"},
    "console": {"engine", "server", "router", "fleet", "chains", "bench"},
    "fleet": {"engine", "server", "chains", "bench"},
    "tenants": {"engine", "layers", "models", "loader", "kernels", "server", "router", "fleet", "chains", "console",
                "bench", "memory"},
}


def _imports() -> list[tuple[Path, str, list[str]]]:
    out = []
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tripod"):
                out.append((path, node.module, [a.name for a in node.names]))
            elif isinstance(node, ast.Import):
                out += [(path, a.name, []) for a in node.names if a.name.startswith("tripod")]
    return out


def test_dependencies_point_down() -> None:
    bad = []
    for path, module, names in _imports():
        pkg = path.relative_to(ROOT).parts[0]
        parts = module.split(".")
        targets = {parts[1]} if len(parts) > 1 else set(names)
        hit = targets & FORBIDDEN.get(pkg, set())
        if hit:
            bad.append(f"{path.relative_to(ROOT.parent)} imports {module} ({', '.join(sorted(hit))})")
    assert not bad, "imports against the package map:\n" + "\n".join(bad)


def _module_of(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
    """Module -> the tripod modules it imports, wherever the import stands (a function body, an
    ``if TYPE_CHECKING:`` block): ``from a.b import c`` names ``a.b.c`` when that is a module, else
    ``a.b``. A package's own ``__init__`` is not implied by importing one of its modules."""
    modules = {_module_of(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for t in targets:
                while t and t not in modules:
                    t = t.rpartition(".")[0]
                if t.startswith("tripod") and t != name:
                    edges.add(t)
        graph[name] = edges
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected sets of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                group = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    group.append(w)
                    if w == v:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return found


def test_no_import_circles() -> None:
    circles = _circles(_import_graph())
    assert not circles, "modules that import each other (directly or around a circle):\n" + "\n".join(
        " <-> ".join(c) for c in circles)


def test_the_circle_finder_finds_circles() -> None:
    """The check above can fail: a circle through a lazy import is found, a chain is not."""
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80


def test_modules_and_functions_stay_short() -> None:
    long = []
    for path in sorted(ROOT.rglob("*.py")):
        text = path.read_text()
        where = path.relative_to(ROOT.parent)
        if text.count("\n") > MAX_MODULE_LINES:
            long.append(f"{where}: {text.count(chr(10))} lines (at most {MAX_MODULE_LINES})")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{where}:{node.lineno} {node.name}: {n} lines (at most {MAX_FUNCTION_LINES})")
    assert not long, "\n".join(long)


def test_class_names_are_unique() -> None:
    """One name, one class: a reader (and a traceback) can tell ``EngineStats`` from ``EngineStats``."""
    where: dict[str, list[str]] = {}
    for path in ROOT.rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                where.setdefault(node.name, []).append(str(path.relative_to(ROOT.parent)))
    twice = {name: paths for name, paths in where.items() if len(paths) > 1}
    assert not twice, "\n".join(f"{name}: {', '.join(sorted(p))}" for name, p in sorted(twice.items()))


def test_no_private_name_crosses_a_module() -> None:
    bad = [f"{path.relative_to(ROOT.parent)}: from {module} import {name}"
           for path, module, names in _imports() for name in names
           if name.startswith("_") and not name.startswith("__")]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("module", [
    "tripod.protocol.engine_ipc", "tripod.protocol.stats", "tripod.protocol.failover", "tripod.protocol.chains",
    "tripod.protocol.sampling", "tripod.protocol.health", "tripod.protocol.fleet", "tripod.tenants", "tripod.config", "tripod.memory.radix", "tripod.detokenizer", "tripod.asgi", "tripod.tracing", "tripod.router.app",
    "tripod.fleet.launch",
])
def test_torch_free(module: str) -> None:
    """The edge types and the router/fleet load without torch (a router starts in well under a second)."""
    code = f"import sys, {module}; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0, f"importing {module} loads torch"
