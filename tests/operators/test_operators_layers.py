"""The layers of hetflow.operators stay clean: read from the source with ``ast``, no import run.

* no import cycle between its modules, counting every import that runs (module level and
  function-local; ``if TYPE_CHECKING:`` blocks run only under a type checker);
* it imports nothing else of hetflow (any mpi4py program can use it);
* it reads no ``HETFLOW_*`` environment variable except through ``settings``.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

OPERATORS = Path(__file__).resolve().parents[2] / "operators"


@functools.cache
def _parse(path: Path) -> ast.AST:
    return ast.parse(path.read_text())


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node outside ``if TYPE_CHECKING:`` bodies."""
    out: list[ast.AST] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        out.append(node)
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and isinstance(child.test, ast.Name) and child.test.id == "TYPE_CHECKING":
                stack.extend(child.orelse)
                continue
            stack.append(child)
    return out


def _imports(path: Path, modules: set[str]) -> tuple[set[str], set[str]]:
    """(operators modules ``path`` imports at run time, other hetflow modules it imports)."""
    inside, outside = set(), set()
    for node in _runtime_nodes(_parse(path)):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom):
            if node.level == 1:
                names = [node.module.split(".")[0]] if node.module else [a.name for a in node.names]
            elif node.level == 0 and node.module and node.module.startswith("hetflow"):
                parts = node.module.split(".")
                if parts[:2] == ["hetflow", "operators"]:
                    names = [parts[2]] if len(parts) > 2 else [a.name for a in node.names]
                else:
                    outside.add(node.module)
            elif node.level > 1:
                outside.add("." * node.level + (node.module or ""))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("hetflow.operators."):
                    names.append(alias.name.split(".")[2])
                elif alias.name.startswith("hetflow"):
                    outside.add(alias.name)
        inside |= {n for n in names if n in modules and n != path.stem}
    return inside, outside


def _graph() -> dict[str, set[str]]:
    modules = {p.stem for p in OPERATORS.glob("*.py")} - {"__init__"}
    return {m: _imports(OPERATORS / f"{m}.py", modules)[0] for m in sorted(modules)}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for start in graph:
        if start not in state:
            found = visit(start)
            if found:
                return found
    return None


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_no_import_cycle_between_operator_modules() -> None:
    graph = _graph()
    assert {"aggregate", "dtable", "filesplit", "scan", "outofcore"} <= set(graph)
    assert _cycle(graph) is None, f"import cycle: {' -> '.join(_cycle(graph) or [])}"
    # the facade sits on top: the functions it wraps never import it
    for module in ("aggregate", "filesplit", "hashjoin", "sorting", "outofcore", "collectives"):
        assert "dtable" not in graph[module], f"{module} imports dtable"


def test_operators_import_nothing_else_of_hetflow() -> None:
    modules = {p.stem for p in OPERATORS.glob("*.py")}
    for path in sorted(OPERATORS.glob("*.py")):
        assert _imports(path, modules)[1] == set(), path.name


def test_operators_read_no_hetflow_environment_variable_but_through_settings() -> None:
    pattern = re.compile(r"""environ(?:\.get)?\s*[\[(]\s*["']HETFLOW_|getenv\(\s*["']HETFLOW_""")
    for path in sorted(OPERATORS.glob("*.py")):
        if path.name != "settings.py":
            assert not pattern.search(path.read_text()), f"{path.name} reads a HETFLOW_ variable"
    assert "os.environ" in (OPERATORS / "settings.py").read_text()
