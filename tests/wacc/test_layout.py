"""The judge's layout: dependencies inside ``wacc`` run one way.

The judge's core is ``wacc/judge/``; the commands, the gate, the report, the audit and the pytest
plugin use it, and it uses none of them. No two modules of ``wacc`` import each other, directly or
through others, not even inside a function (a lazy import hides a cycle, it does not remove it).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
USERS_OF_THE_JUDGE = (
    "wacc.audit",
    "wacc.cli",
    "wacc.commands",
    "wacc.gate",
    "wacc.pytest_plugin",
    "wacc.report",
)


def _modules(package: str = "wacc") -> dict[str, Path]:
    found = {}
    for path in sorted((REPO / package).rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """Nodes under ``if TYPE_CHECKING:`` (annotations only: never run)."""
    hidden: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            hidden.update(id(child) for child in ast.walk(node))
    return hidden


def _imported(name: str, path: Path, modules: Mapping[str, Path]) -> Iterator[str]:
    """Every module of ``modules`` that ``name`` imports, at any depth of its code."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    hidden = _type_checking_nodes(tree)
    for node in ast.walk(tree):
        if id(node) in hidden:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                yield full if full in modules else node.module
        elif isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)


def import_graph() -> dict[str, set[str]]:
    """``wacc``'s modules -> the ``wacc`` modules each imports (its own parent packages left out:
    importing ``wacc.judge.verdict`` runs ``wacc/__init__.py`` whatever imports it)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = {t for t in _imported(name, path, modules) if t in modules}
        graph[name] = {t for t in targets if t != name and not name.startswith(t + ".")}
    return graph


def cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_cycles_finds_a_cycle_through_a_lazy_import_and_nothing_in_a_chain() -> None:
    """The helper itself: a ring of three is one component; a chain and a self-loop are none."""
    ring = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(ring) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_import_graph_sees_imports_inside_functions(tmp_path: Path) -> None:
    """A ``from wacc.x import y`` inside a function body is an edge; one under TYPE_CHECKING is
    not."""
    source = tmp_path / "m.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from wacc.judge.verdict import ScenarioVerdict\n"
        "def f():\n    from wacc.judge.runner import run_implementation\n",
        encoding="utf-8",
    )
    modules = {"wacc.judge.runner": Path(), "wacc.judge.verdict": Path()}
    assert set(_imported("m", source, modules)) == {"wacc.judge.runner", "typing"}


def test_no_module_of_wacc_imports_itself_through_others() -> None:
    """No import cycle inside ``wacc``: the engine and the stateful machine, the implementation
    protocol and the runner, the audit's isolation and its runner each depend one way."""
    found = cycles(import_graph())
    assert found == [], f"import cycles inside wacc: {found}"


def test_the_judge_uses_none_of_the_commands_the_gate_the_report_or_the_audit() -> None:
    """``wacc.judge`` is the core: nothing in it imports a package or module that uses it."""
    graph = import_graph()
    wrong = sorted(
        (module, target)
        for module, targets in graph.items()
        if module.startswith("wacc.judge")
        for target in targets
        if target.startswith(USERS_OF_THE_JUDGE)
    )
    assert wrong == [], f"the judge imports its users: {wrong}"
