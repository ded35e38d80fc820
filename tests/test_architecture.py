"""The house rules that keep the package easy to change: imports point one way (no circle, counting imports
under ``TYPE_CHECKING`` and inside functions) and no module grows past about 600 lines."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
MAX_LINES = 650  # "about 600": a module past this is split by concern


def _modules() -> dict[str, Path]:
    found = {}
    for path in (SRC / "bsrkit").rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports anywhere in its text (top level, ``TYPE_CHECKING``
    blocks, function bodies); ``from bsrkit.x import name`` counts as importing ``bsrkit.x.name`` when
    that is a module, else ``bsrkit.x``."""
    modules = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if (
                isinstance(node, ast.ImportFrom)
                and node.level == 0
                and (node.module or "").startswith("bsrkit")
            ):
                assert node.module is not None
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                           for a in node.names]  # fmt: skip
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.startswith("bsrkit")]
            for target in targets:
                resolved = resolve(target)
                if resolved is not None and resolved != module:
                    graph[module].add(resolved)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append([*stack[stack.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return cycles


def test_no_import_circle_anywhere():
    graph = import_graph()
    assert graph["bsrkit.ops"] >= {"bsrkit.dispatch", "bsrkit.shortcuts"}  # (the graph is read at all)
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_past_about_600_lines():
    sizes = {m: len(p.read_text().splitlines()) for m, p in _modules().items()}
    assert {m: n for m, n in sizes.items() if n > MAX_LINES} == {}
