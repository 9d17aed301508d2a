"""The package map's rules, checked on the source (``docs/architecture.md``, "Package map"):
dependencies point down only, nobody imports another module's private names, and the modules that
cross process edges or run in the router stay free of torch."""

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
    "server": {"router", "fleet", "chains", "bench"},
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


def test_no_private_name_crosses_a_module() -> None:
    bad = [f"{path.relative_to(ROOT.parent)}: from {module} import {name}"
           for path, module, names in _imports() for name in names
           if name.startswith("_") and not name.startswith("__")]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("module", [
    "tripod.protocol.engine_ipc", "tripod.protocol.stats", "tripod.protocol.failover", "tripod.protocol.chains",
    "tripod.protocol.sampling", "tripod.protocol.health", "tripod.protocol.fleet", "tripod.tenants", "tripod.config", "tripod.memory.radix", "tripod.asgi", "tripod.tracing", "tripod.router.app",
    "tripod.fleet.launch",
])
def test_torch_free(module: str) -> None:
    """The edge types and the router/fleet load without torch (a router starts in well under a second)."""
    code = f"import sys, {module}; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0, f"importing {module} loads torch"
