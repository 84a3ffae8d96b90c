"""The package's import graph, read from the source with ``ast`` (nothing is imported): no circle, no module
importing another module's private (``_name``) names, and the layers import only downward.

Every import counts, also those inside functions: a lazy import hides a circle from Python, not from a reader.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "lorapack"

# Layers, lowest first; a module may import its own layer (the graph has no circle) and the ones below.
# A module not listed by a prefix belongs to APPLICATIONS (validate, calibrate, sweep, placement, ...).
APPLICATIONS = "applications"
LAYERS: tuple[tuple[str, ...], ...] = (
    # foundations: errors, argument checks, text files in and out, the executor, searches over integers
    ("lorapack", "lorapack.errors", "lorapack.checks", "lorapack.textfiles", "lorapack.executor",
     "lorapack.monotone"),
    # validated inputs (the objective: what a GPU must achieve); the twin's data types and step-time estimator
    # (pure functions of arrays); resource limits and the cost of a run from its arrays
    ("lorapack.profile", "lorapack.spec", "lorapack.server", "lorapack.objective", "lorapack.twin.types",
     "lorapack.twin.steptime", "lorapack.guards"),
    ("lorapack.workload",),  # requests from a workload
    ("lorapack.twin",),  # the digital twin
    ("lorapack.realruns", "lorapack.oracle"),  # the twin's seams: real runs, feasibility questions
    (APPLICATIONS,),
    ("lorapack.cli",),  # the command line: nothing imports it
)


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted((SRC / PACKAGE).rglob("*.py")):
        parts = path.relative_to(SRC).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> list[tuple[str, str, int]]:
    """``(imported module, imported name or "", line)`` for every lorapack import of module ``name``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(a.name, "", node.lineno) for a in node.names if a.name.split(".")[0] == PACKAGE]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != PACKAGE:
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.append((sub, "", node.lineno) if sub in MODULES else (target, alias.name, node.lineno))
    return found


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _layer(module: str) -> int:
    best, best_len = None, -1
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            exact_only = p == PACKAGE
            hit = module == p or (not exact_only and module.startswith(p + "."))
            if hit and len(p) > best_len:
                best, best_len = i, len(p)
    if best is None:
        return next(i for i, prefixes in enumerate(LAYERS) if APPLICATIONS in prefixes)
    return best


def find_cycles(graph: dict) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    edges = {m: sorted({t for t, _, _ in graph[m] if t in graph and t != m}) for m in graph}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in edges:
        if v not in index:
            visit(v)
    return out


def test_the_graph_is_read() -> None:
    assert {"lorapack.spec", "lorapack.twin.engine", "lorapack.cli"} <= set(MODULES)
    assert any(t == "lorapack.twin.engine" for t, _, _ in GRAPH["lorapack.twin.run"])


def find_private_imports(graph: dict) -> list[str]:
    return [f"{m}:{line}: from {t} import {n}" for m, imports in graph.items() for t, n, line in imports
            if n.startswith("_") and not n.startswith("__") and t != m]


def find_upward_imports(graph: dict) -> list[str]:
    return [f"{m}:{line}: {m} (layer {_layer(m)}) imports {t} (layer {_layer(t)})"
            for m, imports in graph.items() for t, _n, line in imports if _layer(t) > _layer(m)]


def test_no_import_circle() -> None:
    cycles = find_cycles(GRAPH)
    assert not cycles, "modules that import each other in a circle: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_no_private_name_is_imported_from_another_module() -> None:
    bad = find_private_imports(GRAPH)
    assert not bad, "private names imported across modules:\n" + "\n".join(bad)


def test_layers_import_only_downward() -> None:
    bad = find_upward_imports(GRAPH)
    assert not bad, "imports that run up the layers:\n" + "\n".join(bad)


def test_the_checks_can_fail() -> None:
    """A planted circle, private import and upward import are all reported."""
    planted = dict(GRAPH)
    planted["lorapack.errors"] = [*GRAPH["lorapack.errors"], ("lorapack.cli", "_console", 1)]
    planted["lorapack.cli"] = [*GRAPH["lorapack.cli"], ("lorapack.errors", "", 1)]
    assert any({"lorapack.errors", "lorapack.cli"} <= set(c) for c in find_cycles(planted))
    assert "lorapack.errors:1: from lorapack.cli import _console" in find_private_imports(planted)
    assert any(b.startswith("lorapack.errors:1: lorapack.errors") for b in find_upward_imports(planted))
