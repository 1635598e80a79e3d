"""The shape of the package: no import circles, no module over 600 lines, names that stay put.

Imports are read from the source (module-level and inside functions alike, since a lazy import
is still a dependency), so a circle is found however it is hidden.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "shardwise"
PACKAGE = "shardwise"


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> list[str]:
    """The shardwise modules an `import from` names (a name may be a submodule)."""
    if node.level:
        base = module.split(".")
        base = base if is_package else base[:-1]
        base = base[: len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    if not target.startswith(PACKAGE):
        return []
    return [target] + [f"{target}.{a.name}" for a in node.names]


def import_graph() -> dict[str, set[str]]:
    """module -> the shardwise modules it imports (anywhere in its body)."""
    files = {_module_name(p): p for p in SRC.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in files}
    for module, path in files.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom):
                targets = _resolve(module, path.name == "__init__.py", node)
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.startswith(PACKAGE)]
            graph[module].update(t for t in targets if t in files and t != module)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle, as the modules along it, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def _parents(module: str) -> set[str]:
    """A package's __init__ runs before its submodules: importing `a.b.c` imports `a.b`."""
    parts = module.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def test_no_import_circle() -> None:
    graph = import_graph()
    # package initialisers: shardwise/__init__ is the public API (it imports the engine), and a
    # subpackage's __init__ re-exports its modules; neither is a dependency of theirs
    edges = {m: {t for t in ts if t not in _parents(m)} for m, ts in graph.items()}
    assert find_cycle(edges) is None, " -> ".join(find_cycle(edges) or [])


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_nothing_below_the_engine_imports_it() -> None:
    graph = import_graph()
    importers = sorted(m for m, ts in graph.items() if "shardwise.engine" in ts)
    # only the public API, and the Accelerate-named class that builds on the engine
    assert importers == ["shardwise", "shardwise.accelerator"], importers


@pytest.mark.parametrize("path", sorted(SRC.rglob("*.py")), ids=lambda p: str(p.relative_to(SRC)))
def test_module_size(path: Path) -> None:
    lines = len(path.read_text().splitlines())
    assert lines <= 600, f"{path.relative_to(SRC)} has {lines} lines; split it where the code has seams"
