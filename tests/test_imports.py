"""The package's import graph has no circles, counting every import of an hf_spin module wherever it sits
(module level, inside a function, under `TYPE_CHECKING`): a circle cannot hide in a function-local import.

`from pkg import name` is an edge to `pkg.name` where that is a module, else to `pkg` (its `__init__`).
Implicit parent-package imports are not edges: `import hf_spin.step.engine` runs `hf_spin/__init__.py`
first, which never imports its own importers back.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "hf_spin"


def module_name(path: Path, root: Path = PACKAGE) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the hf_spin modules it imports, from every `import` statement in its source."""
    files = {module_name(p, root): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = graph.setdefault(name, set())
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                edges.update(a.name for a in node.names if a.name in files)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                if source.split(".")[0] != root.name:
                    continue
                for alias in node.names:
                    edges.add(f"{source}.{alias.name}" if f"{source}.{alias.name}" in files else source)
        edges.discard(name)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle as [a, b, ..., a], or None (depth-first search, three colours)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_package_has_no_import_circle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_a_circle_hidden_in_a_function_is_found(tmp_path):
    pkg = tmp_path / "hf_spin"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from .a import A\n")
    (pkg / "sub" / "a.py").write_text("from ..b import B\nA = 1\n")
    (pkg / "b.py").write_text("def f():\n    from .sub import A\n    return A\nB = 2\n")
    assert find_cycle(import_graph(pkg)) == ["hf_spin.b", "hf_spin.sub", "hf_spin.sub.a", "hf_spin.b"]
    (pkg / "b.py").write_text("B = 2\n")
    assert find_cycle(import_graph(pkg)) is None


@pytest.mark.parametrize("module", ["hf_spin.step.engine", "hf_spin.planning.planner", "hf_spin.kernels.torch_varlen"])
def test_graph_sees_the_rooms(module):
    assert module in import_graph()
