"""The package's import graph, read with the standard ``ast`` module (every import statement, including the lazy
ones inside functions): no cycle, and the dependency direction of the design holds:
``tree/`` <- ``dsv4/`` <- ``speculative/`` <- ``plugin.py`` (``cpu/``, the platform support, reads V4 configs
through ``dsv4.config`` and is asked by ``speculative/`` whether the machine is CPU-only), with the math in
``tree/`` and ``dsv4/`` free of sglang (only ``dsv4/sglang_model.py``, the adapter, ``dsv4/sglang_pool.py``, its
KV pool, and ``dsv4/tp.py``, the swap to SGLang's parallel layers, may import it)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "python" / "sglang_tree_v4"
PACKAGE = "sglang_tree_v4"
# layer -> the layers it may import (besides itself and the package's small shared modules)
ALLOWED = {
    "tree": set(),
    "dsv4": {"tree"},
    "speculative": {"tree", "dsv4", "cpu"},
    "cpu": {"dsv4"},
    "plugin": {"cpu", "speculative"},
}
SGLANG_ADAPTERS = {f"{PACKAGE}.dsv4.sglang_model", f"{PACKAGE}.dsv4.sglang_pool", f"{PACKAGE}.dsv4.tp"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> tuple[set[str], set[str]]:
    """-> (internal modules imported, top-level external packages imported)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    internal, external = set(), set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # ``from pkg import sub`` imports the submodule ``pkg.sub`` where one exists
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for t in targets:
            if t.split(".")[0] == PACKAGE:
                while t not in modules and "." in t:
                    t = t.rpartition(".")[0]
                if t != name:
                    internal.add(t)
            else:
                external.add(t.split(".")[0])
    return internal, external


def _graph():
    files = {_module_name(p): p for p in PACKAGE_DIR.rglob("*.py")}
    return {m: _imports(p, set(files)) for m, p in files.items()}


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ALLOWED else None


def test_graph_is_read():
    graph = _graph()
    assert f"{PACKAGE}.speculative.worker" in graph and f"{PACKAGE}.dsv4.model" in graph
    assert f"{PACKAGE}.dsv4.mtp" in graph[f"{PACKAGE}.dsv4.model"][0]  # the reader does see imports
    assert not any(m.split(".")[1] == "spec" for m in graph if m.count(".")), "the old package name is gone"


def test_no_import_cycle():
    graph = {m: deps for m, (deps, _) in _graph().items()}
    state: dict[str, int] = {}  # 1 = on the current path, 2 = finished
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                cycle = stack[stack.index(d):] + [d]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_dependency_direction():
    bad = []
    for module, (deps, external) in _graph().items():
        layer = _layer(module)
        if layer is None:
            continue
        for d in deps:
            other = _layer(d)
            if other is not None and other != layer and other not in ALLOWED[layer]:
                bad.append(f"{module} imports {d}")
        if layer in ("tree", "dsv4") and "sglang" in external and module not in SGLANG_ADAPTERS:
            bad.append(f"{module} imports sglang")
    assert not bad, "\n".join(bad)
