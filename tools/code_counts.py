"""Counts of the code's shape, for issue notes and reviews: top-level modules, imports inside
function bodies (by kind), `Any` in signatures, and module-level mutable state.

    python tools/code_counts.py [src/shardwise]
"""

from __future__ import annotations

import ast
import sys
from collections import Counter
from pathlib import Path

OPTIONAL = ("transformers", "deepspeed", "peft", "diffusers", "safetensors", "accelerate", "yaml",
            "tensorboard", "wandb", "mlflow", "psutil", "tqdm", "rich", "matplotlib")
MUTABLE_CALLS = ("dict", "list", "set", "defaultdict", "OrderedDict", "Counter", "deque",
                 "WeakKeyDictionary", "WeakValueDictionary", "WeakSet")


def import_kind(node: ast.Import | ast.ImportFrom) -> str:
    if isinstance(node, ast.ImportFrom) and node.level:
        return "internal"
    name = node.module if isinstance(node, ast.ImportFrom) else node.names[0].name
    top = (name or "").split(".")[0]
    if top == "shardwise":
        return "internal"
    if top == "torch":
        return "torch"
    return "optional" if top in OPTIONAL else "other"


def function_imports(tree: ast.Module) -> Counter[str]:
    kinds: Counter[str] = Counter()
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            for node in ast.walk(fn):
                if isinstance(node, ast.Import | ast.ImportFrom):
                    kinds[import_kind(node)] += 1
    return kinds


def mentions_any(annotation: ast.expr | None) -> bool:
    if annotation is None:
        return False
    return any((isinstance(n, ast.Name) and n.id == "Any") or
               (isinstance(n, ast.Attribute) and n.attr == "Any") or
               (isinstance(n, ast.Constant) and isinstance(n.value, str) and "Any" in n.value)
               for n in ast.walk(annotation))


def any_in_signatures(tree: ast.Module) -> int:
    count = 0
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            a = fn.args
            args = [*a.posonlyargs, *a.args, *a.kwonlyargs, *(x for x in (a.vararg, a.kwarg) if x)]
            count += sum(mentions_any(x.annotation) for x in args) + mentions_any(fn.returns)
    return count


def module_state(tree: ast.Module) -> list[str]:
    """Module-level names bound to a mutable container or an instance (not constants, types,
    functions, loggers or TypeVars)."""
    found = []
    for node in tree.body:
        targets: list[ast.expr] = []
        value: ast.expr | None = None
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        if value is None or not all(isinstance(t, ast.Name) for t in targets):
            continue
        mutable = isinstance(value, ast.Dict | ast.List | ast.Set | ast.DictComp | ast.ListComp) or (
            isinstance(value, ast.Constant) and value.value is None)  # filled in later
        if isinstance(value, ast.Call):
            func = value.func
            callee = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            mutable = callee in MUTABLE_CALLS or (callee.lstrip("_")[:1].isupper() and callee not in (
                "TypeVar", "ParamSpec", "NamedTuple", "Path", "frozenset", "Literal"))
        if mutable:
            found += [t.id for t in targets if isinstance(t, ast.Name)]
    return found


MUTATORS = ("append", "add", "update", "clear", "pop", "popitem", "setdefault", "discard", "remove",
            "extend", "insert", "appendleft", "popleft")


def mutated(tree: ast.Module, names: list[str]) -> list[str]:
    """Which of `names` the module itself changes after import: `global` rebinding, item or attribute
    assignment, or a mutating method call (what makes module-level state a singleton)."""
    hits: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            hits.update(n for n in node.names if n in names)
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, ast.AugAssign | ast.AnnAssign) else [])
        for t in targets:
            if isinstance(t, ast.Subscript | ast.Attribute) and isinstance(t.value, ast.Name) \
                    and t.value.id in names:
                hits.add(t.value.id)
        if isinstance(node, ast.Delete):
            hits.update(t.value.id for t in node.targets if isinstance(t, ast.Subscript)
                        and isinstance(t.value, ast.Name) and t.value.id in names)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in MUTATORS and isinstance(node.func.value, ast.Name) \
                and node.func.value.id in names:
            hits.add(node.func.value.id)
    return [n for n in names if n in hits]


def instances(tree: ast.Module) -> list[str]:
    """Module-level names bound to an instance of a class the module defines (state by nature,
    whatever its methods change)."""
    classes = {node.name for node in tree.body if isinstance(node, ast.ClassDef)}
    return [t.id for node in tree.body if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
            and getattr(node.value.func, "id", None) in classes
            for t in node.targets if isinstance(t, ast.Name)]


def singletons(tree: ast.Module) -> list[str]:
    """The module's state: names of `module_state` that are an instance of its own class or that
    it changes after import."""
    names = module_state(tree)
    kept = set(mutated(tree, names)) | set(instances(tree))
    return [n for n in names if n in kept]


def main(root: Path) -> None:
    files = sorted(root.rglob("*.py"))
    imports: Counter[str] = Counter()
    anys = 0
    state: list[str] = []
    for path in files:
        tree = ast.parse(path.read_text(), str(path))
        imports += function_imports(tree)
        anys += any_in_signatures(tree)
        module = ".".join(path.relative_to(root.parent).with_suffix("").parts)
        state += [f"{module}.{name}" for name in singletons(tree)]
    top = [p.name for p in root.glob("*.py")]
    print(f"modules: {len(files)} ({len(top)} at the top level: {', '.join(sorted(top))})")
    print(f"imports inside functions: {sum(imports.values())} ({dict(sorted(imports.items()))})")
    print(f"Any in signatures (parameters and returns): {anys}")
    print(f"module-level state: instances, and containers changed after import ({len(state)}):")
    for name in state:
        print(f"  {name}")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "src/shardwise"))
