"""The shape of the package: no import circles, packages that import only their layer and below,
strategy knowledge in one place, no reach into another object's private fields. (Size is kept in
check by ruff's complexity cap, C901 at 15, in pyproject.toml.)

Imports are read from the source (module-level and inside functions alike, since a lazy import
is still a dependency), so a circle is found however it is hidden. The other checks read the
syntax tree too: a string comparison of a strategy, offload or backend name outside the strategy
layer, or an `obj._private` read outside the shims, fails with the file and line.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from planted import caught, planted_here

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
    check_no_import_circle()


def check_no_import_circle() -> None:
    graph = import_graph()
    # package initialisers: shardwise/__init__ is the public API (it imports the engine), and a
    # subpackage's __init__ re-exports its modules; neither is a dependency of theirs
    edges = {m: {t for t in ts if t not in _parents(m)} for m, ts in graph.items()}
    assert find_cycle(edges) is None, " -> ".join(find_cycle(edges) or [])


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


# -- packages import downwards --------------------------------------------------------------------
# The layers, top to bottom (STYLE.md): the command line and the Accelerate surface use the
# engine; the planner traces the engine's session; the engine uses the strategies, checkpoints,
# weights and the runtime; those use the processes and the config. A package may import its own
# layer and those below, never one above.
LAYERS = {
    "cli": 6, "trainer": 6, "accelerate": 5, "plan": 4, "engine": 3, "strategies": 2,
    "checkpoint": 1, "weights": 1, "runtime": 1, "distributed": 0, "config": 0, "version": 0,
}
# the one upward call: strategy="auto" asks the planner at the first prepare (engine -> plan.auto);
# with the planner's trace of the engine's Session (plan -> engine) it is also the one package circle
# left (`test_no_package_circle` skips it): remove it here once the engine is handed its chooser
UPWARD = {("shardwise.engine.engine", "shardwise.plan.auto")}


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """`module -> target` where the target's package sits above the module's."""
    found = []
    for module, targets in graph.items():
        mine = LAYERS.get(_package(module))
        if mine is None:
            continue  # shardwise/__init__ (the public API) and __main__
        for target in targets:
            theirs = LAYERS.get(_package(target))
            if theirs is None:
                theirs = 7  # the package root: everything
            if theirs > mine and (module, target) not in UPWARD:
                found.append(f"{module} -> {target}")
    return sorted(found)


def test_every_module_sits_in_a_layer() -> None:
    packages = {_package(m) for m in import_graph()} - {""}
    assert packages <= set(LAYERS) | {"__main__"}, sorted(packages - set(LAYERS))


def test_packages_import_only_their_layer_and_below() -> None:
    found = upward_imports(import_graph())
    assert not found, "an import up the layers (see LAYERS):\n" + "\n".join(found)


def test_the_layer_check_finds_an_upward_import() -> None:
    graph = {"shardwise.checkpoint.sharded": {"shardwise.engine.session"},
             "shardwise.engine.session": {"shardwise.checkpoint.sharded"}}
    assert upward_imports(graph) == ["shardwise.checkpoint.sharded -> shardwise.engine.session"]


# -- packages import one way -------------------------------------------------------------------
def package_graph(graph: dict[str, set[str]],
                  skip: set[tuple[str, str]] | None = None) -> dict[str, set[str]]:
    """package -> the other packages of the layers its modules import (the package root and
    __main__, which may import anything, left out), without the module imports in `skip`."""
    packages: dict[str, set[str]] = {}
    for module, targets in graph.items():
        mine = _package(module)
        if mine not in LAYERS:
            continue
        theirs = {_package(t) for t in targets if (module, t) not in (skip or set())}
        packages.setdefault(mine, set()).update(p for p in theirs if p in LAYERS and p != mine)
    for targets in list(packages.values()):
        for p in targets:
            packages.setdefault(p, set())
    return packages


def test_no_package_circle() -> None:
    # two packages that import each other (even through different modules, or inside a
    # function) are one package in two folders; of a layer's packages, one builds on the other
    # (checkpoint on weights: the storage both write through lives in `weights.storage`; the
    # planner on the engine: the engine's strategy="auto" chooser is handed to it from above).
    packages = package_graph(import_graph(), UPWARD)
    cycle = find_cycle(packages)
    assert cycle is None, "packages that import each other: " + " -> ".join(cycle or [])


def test_the_package_circle_finder_finds_one() -> None:
    graph = {"shardwise.checkpoint.files": {"shardwise.weights.export"},
             "shardwise.weights.export": {"shardwise.checkpoint.storage"},
             "shardwise.checkpoint.storage": set()}
    assert find_cycle(package_graph(graph)) == ["checkpoint", "weights", "checkpoint"]
    upward = {("shardwise.weights.export", "shardwise.checkpoint.storage")}
    assert find_cycle(package_graph(graph, upward)) is None


def test_nothing_below_the_engine_imports_it() -> None:
    check_nothing_below_the_engine_imports_it()


def test_planted_lazy_engine_import_is_caught() -> None:
    """`lazy_engine_import`: a function-level import of the Engine in the checkpoint package
    (hidden from a module-level reading); the circle check and the importers check both fail."""
    with planted_here("lazy_engine_import"):
        assert "shardwise.checkpoint.sharded -> shardwise.engine.engine" in caught(
            check_no_import_circle, must=r"shardwise\.checkpoint\.sharded -> shardwise\.engine\.engine")
        assert "shardwise.checkpoint.sharded" in caught(
            check_nothing_below_the_engine_imports_it,
            must=r"^\['shardwise', 'shardwise\.accelerate\.accelerator', 'shardwise\.checkpoint\.sharded', "
                 r"'shardwise\.engine'\]")


def check_nothing_below_the_engine_imports_it() -> None:
    graph = import_graph()
    importers = sorted(m for m, ts in graph.items() if "shardwise.engine.engine" in ts)
    # the public API, the engine package's own re-export, and the Accelerate-named class
    assert importers == ["shardwise", "shardwise.accelerate.accelerator", "shardwise.engine"], importers


# -- strategy knowledge lives in the spec tables ------------------------------------------------
# The layer that may name strategies: the strategies themselves, the config tree that holds the
# tables (config.StrategySpec & co.), and the translation of other tools' files and of flags.
NAME_LAYER = ("strategies/", "config/")
# names only a strategy, offload or backend has: any comparison against them is strategy knowledge
UNAMBIGUOUS = {"ddp", "zero1", "zero2", "zero3", "deepspeed"}
# words that are names here but ordinary words elsewhere ("torch" a pickle module, "optimizer" a
# key): a comparison counts when the other side is a strategy, offload, backend or precision field
AMBIGUOUS = {"auto", "none", "optimizer", "params", "torch", "fp16", "bf16", "fp32"}
FIELD = re.compile(r"strateg|offload|backend|precision")
PRECISION_LAYER = ("strategies/precision.py",)  # the precision component decides on its own name


def _constants(node: ast.expr) -> set[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return {c for e in node.elts for c in _constants(e)}
    return set()


def name_comparisons(source: str) -> list[tuple[int, str]]:
    """(line, source) of each comparison of a strategy, offload, backend or precision name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        if not all(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn, ast.Is, ast.IsNot))
                   for op in node.ops):
            continue
        sides = [node.left, *node.comparators]
        for i, side in enumerate(sides):
            names = _constants(side)
            others = " ".join(ast.unparse(o) for j, o in enumerate(sides) if j != i)
            if names & UNAMBIGUOUS or (names & AMBIGUOUS and FIELD.search(others)):
                found.append((node.lineno, ast.unparse(node)))
                break
    return found


def test_the_name_comparison_finder_finds_them() -> None:
    code = (
        'a = cfg.offload == "none"\n'
        'b = c.strategy in ("zero2", "zero3")\n'
        'c = x == "zero3"\n'
        'd = self.config.backend != "deepspeed"\n'
        'e = name == "optimizer"\n'  # a key, not an offload: not counted
        'f = module == "torch"\n'
    )
    assert sorted(line for line, _ in name_comparisons(code)) == [1, 2, 3, 4]


def test_no_strategy_name_compared_outside_the_strategy_layer() -> None:
    found = []
    for path in sorted(SRC.rglob("*.py")):
        rel = str(path.relative_to(SRC))
        if rel.startswith(NAME_LAYER) or rel in NAME_LAYER:
            continue
        for line, text in name_comparisons(path.read_text()):
            if rel in PRECISION_LAYER and not (_constants(ast.parse(text, mode="eval").body) & UNAMBIGUOUS):
                continue
            found.append(f"{rel}:{line}: {text}")
    assert not found, ("ask config.STRATEGY_TABLE / OFFLOAD_TABLE / BACKEND_TABLE (a spec property) instead "
                       "of comparing names:\n" + "\n".join(found))


# -- no reach into another object's private fields -----------------------------------------------
# The shims: the only modules that may touch another library's private names, each listing them
# in its docstring with the versions it was checked against.
SHIMS = ("distributed/internals.py", "strategies/deepspeed/internals.py", "plan/fakes.py")
# private names that are the documented way to do something, allowed anywhere
IDIOMS = {
    "_parameters", "_buffers", "_modules",  # nn.Module's registries (torch's own advice for subclasses)
    "_exit", "_getframe",  # os._exit, sys._getframe
    "_replace", "_asdict", "_fields", "_make",  # namedtuple's public API
}
# one more library's private name, kept in the one function that needs it (file -> names)
ALLOWED = {
    # accelerate's PartialState, shared so accelerate.logging works
    "accelerate/extras.py": {"_shared_state"},
    "cli/main.py": {"_actions"},  # torchrun's own argparse parser: argparse lists its flags no other way
    # transformers' config names its attention implementation only so (`attention_of`)
    "strategies/context_parallel.py": {"_attn_implementation"},
}


def private_reads(source: str) -> list[tuple[int, str]]:
    """(line, source) of each `obj._name` where obj is not self/cls, and each import of a private
    module or name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            attr = node.attr
            if not attr.startswith("_") or attr.startswith("__") or attr in IDIOMS:
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
            if (any(part.startswith("_") and not part.startswith("__") for part in module.split("."))
                    or private):
                found.append((node.lineno, f"from {'.' * node.level}{module} import "
                                           f"{', '.join(a.name for a in node.names)}"))
        elif isinstance(node, ast.Import):
            for a in node.names:
                if any(part.startswith("_") and not part.startswith("__") for part in a.name.split(".")):
                    found.append((node.lineno, f"import {a.name}"))
    return found


def test_the_private_read_finder_finds_them() -> None:
    code = (
        "a = loader._epoch\n"
        "b = self._epoch\n"
        "c = m._parameters\n"
        "from torch.utils._pytree import tree_leaves\n"
        "from .presets import _batch_dim\n"
        "d = super()._x\n"
    )
    assert sorted(line for line, _ in private_reads(code)) == [1, 4, 5, 6]


def test_no_private_reach_through_outside_the_shims() -> None:
    found = []
    for path in sorted(SRC.rglob("*.py")):
        rel = str(path.relative_to(SRC))
        if rel in SHIMS:
            continue
        allowed = ALLOWED.get(rel, set())
        for line, text in private_reads(path.read_text()):
            if text.rsplit(".", 1)[-1] in allowed:
                continue
            found.append(f"{rel}:{line}: {text}")
    assert not found, ("add a public method on the owner, or put a library's private name behind a function "
                       "in a shim (" + ", ".join(SHIMS) + "):\n" + "\n".join(found))


def test_shims_list_what_they_touch() -> None:
    for rel in SHIMS:
        path = SRC / rel
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        assert "checked against" in doc, (
            f"{rel}: its docstring must say which versions it was checked against")
        names = {t.rsplit(".", 1)[-1] for _, t in private_reads(path.read_text()) if "import" not in t}
        missing = sorted(n for n in names if n not in doc)
        assert not missing, f"{rel}: its docstring does not list {missing}"


# -- no assignment to torch's own attributes --------------------------------------------------------
# left in two shims, each saved and put back around its use: the launcher's (torchrun's agent calls
# `_terminate_process_handler` for every signal it stops on, with no public way to be told:
# `distributed/internals.terminate_handler`) and the planner's fake world (c10d's group count,
# `plan/fakes.py`)
TORCH_PATCHES_ALLOWED = {"distributed/internals.py", "plan/fakes.py"}


def torch_attribute_assignments(source: str) -> list[tuple[int, str]]:
    """(line, source) of each assignment to an attribute of a torch module or class (`dist.x = `,
    `setattr(nn.Module, ...)`), names bound by `import torch...` / `from torch... import ...`."""
    tree = ast.parse(source)
    bound = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names if a.name.startswith("torch")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
            bound |= {a.asname or a.name for a in node.names}

    def torchy(expr: ast.expr) -> bool:
        while isinstance(expr, ast.Attribute):
            expr = expr.value
        return isinstance(expr, ast.Name) and expr.id in bound

    found = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else []
        if any(isinstance(t, ast.Attribute) and torchy(t.value) for t in targets):
            found.append((node.lineno, ast.unparse(node)))
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
                and node.args and torchy(node.args[0])):
            found.append((node.lineno, ast.unparse(node)))
    return found


def test_the_torch_patch_finder_finds_them() -> None:
    code = ("import torch.distributed as dist\nfrom torch import nn\n"
            "dist.is_initialized = lambda: False\n"
            "setattr(nn.Module, 'register_parameter', f)\n"
            "model.forward = g\n")
    assert [line for line, _ in torch_attribute_assignments(code)] == [3, 4]


def test_no_assignment_to_a_torch_attribute() -> None:
    found = [f"{path.relative_to(SRC)}:{line}: {text}" for path in sorted(SRC.rglob("*.py"))
             if str(path.relative_to(SRC)) not in TORCH_PATCHES_ALLOWED
             for line, text in torch_attribute_assignments(path.read_text())]
    assert not found, ("torch's own attributes changed (use a public hook, or say it explicitly):\n"
                       + "\n".join(found))
