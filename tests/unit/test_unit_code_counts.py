"""tools/code_counts.py, the counts quoted in docs/layout.md and issue notes, on small sources:
it must find module-level state that changes (and only that), imports inside functions by kind,
and `Any` in signatures."""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("code_counts", ROOT / "tools" / "code_counts.py")
assert spec is not None and spec.loader is not None
counts = importlib.util.module_from_spec(spec)
spec.loader.exec_module(counts)

SOURCE = '''
from typing import Any
TABLE = {"a": 1}                 # read only: not state
_SEEN: set[str] = set()          # added to below: state
_CACHE = None                    # rebound through `global`: state
_NAMES = ["x"]                   # read only
class _Writer: ...
WRITER = _Writer()               # an instance of the module's own class: state

def f(x: Any, *args: Any) -> dict[str, Any]:
    import torch
    from shardwise.config import tree
    import deepspeed
    _SEEN.add("f")
    return {}

def g() -> None:
    global _CACHE
    _CACHE = 1
    print(TABLE["a"], _NAMES[0])
'''


def test_module_state_is_what_changes_after_import() -> None:
    assert counts.singletons(ast.parse(SOURCE)) == ["_SEEN", "_CACHE", "WRITER"]


def test_imports_inside_functions_by_kind() -> None:
    assert dict(counts.function_imports(ast.parse(SOURCE))) == {"torch": 1, "internal": 1, "optional": 1}


def test_any_in_signatures() -> None:
    assert counts.any_in_signatures(ast.parse(SOURCE)) == 3  # x, *args, the return


def test_the_package_today_lists_the_state_layout_md_names() -> None:
    tool, package = ROOT / "tools" / "code_counts.py", ROOT / "src" / "shardwise"
    out = subprocess.run([sys.executable, str(tool), str(package)],
                         check=True, capture_output=True, text=True).stdout
    state = [line.strip() for line in out.split("module-level state")[1].splitlines()[1:]]
    layout = (ROOT / "docs" / "layout.md").read_text()
    missing = [name for name in state if name.removeprefix("shardwise.") not in layout]
    assert state and not missing, f"module-level state not named in docs/layout.md: {missing}"
