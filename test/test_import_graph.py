"""The package's import graph, read with the standard ``ast`` module (every import statement, including the lazy
ones inside functions): no cycle, and the layers of the design import one way only:

``tree/`` (tree math) <- ``dsv4/`` (the model and its state) <- ``checkpoint/`` (formats, the quantization swap,
tensor-parallel sharding) <- ``serving/`` (SGLang's model and KV pool adapters) <- ``speculative/`` (the TREE_V4
worker and its SGLang hooks) <- ``plugin.py``; ``cpu/`` (platform support) reads configs and the pool's layout;
``footprint/`` and ``step_cost/`` (the reports) and ``testing/`` (launcher, prompts, runners for tests and
benchmarks) sit on top, and no product layer imports them. ``tree/``, ``dsv4/`` and ``checkpoint/`` are free of
sglang, except ``checkpoint/tp``, the swap to SGLang's parallel layers.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "python" / "sglang_tree_v4"
PACKAGE = "sglang_tree_v4"
# layer -> the layers it may import (besides itself and the package's small shared modules)
ALLOWED = {
    "tree": set(),
    "dsv4": {"tree"},
    "checkpoint": {"tree", "dsv4"},
    "serving": {"tree", "dsv4", "checkpoint"},
    "cpu": {"dsv4", "serving"},
    "speculative": {"tree", "dsv4", "checkpoint", "serving", "cpu"},
    "plugin": {"cpu", "speculative"},
    "footprint": {"tree", "dsv4", "checkpoint", "serving", "speculative"},
    "step_cost": {"tree", "dsv4", "checkpoint", "serving", "speculative"},
    "testing": {"tree", "dsv4", "checkpoint", "serving", "speculative", "cpu"},
}
SGLANG_FREE = ("tree", "dsv4", "checkpoint")
SGLANG_ADAPTERS = {f"{PACKAGE}.checkpoint.tp"}


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
    assert f"{PACKAGE}.serving.sglang_model" in graph and f"{PACKAGE}.checkpoint.weights" in graph
    assert not any(_layer(m) is None for m in graph if m.count(".") > 1), "every subpackage is a known layer"


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
        if layer in SGLANG_FREE and "sglang" in external and module not in SGLANG_ADAPTERS:
            bad.append(f"{module} imports sglang")
    assert not bad, "\n".join(bad)
