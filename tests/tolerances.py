"""The tolerance sweep (SHARDWISE_TOLERANCE_RECORD=file): how far each bound in the suite is from
what its run measures.

With the variable set (and pytest's `-o enable_assertion_pass_hook=true`), every passing
comparison of two numbers in a test's assert (`worst <= 5e-5`, `W.close(...) < 1e-5`, `share >
0.45`), every `pytest.approx` comparison and every `torch.testing.assert_close` appends one JSON
line: the test, the line, the measured value and the bound, and their ratio (bound over
measured for an upper bound, measured over bound for a lower one; inf where the run measured
0). `python tests/tolerances.py FILE` lists the bounds within 2x of what their run measured,
the tightest first: a bound with no margin lets round-off that differs between machines decide
the result.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Any

RECORD = os.environ.get("SHARDWISE_TOLERANCE_RECORD")
_COMPARE = re.compile(r"^\s*(?:assert\s+)?([-+0-9.eE]+|inf)\s*(<=|<|>=|>)\s*([-+0-9.eE]+|inf)\s*$")


def _write(kind: str, measured: float, bound: float, upper: bool, where: str) -> None:
    if RECORD is None or not all(isinstance(x, (float, int)) for x in (measured, bound)):
        return
    measured, bound = abs(float(measured)), abs(float(bound))
    if upper:
        ratio = math.inf if measured == 0 else bound / measured
    else:
        ratio = math.inf if bound == 0 else measured / bound
    line = {"test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0], "kind": kind, "where": where,
            "measured": measured, "bound": bound, "upper": upper, "ratio": ratio}
    with open(RECORD, "a") as f:
        f.write(json.dumps(line) + "\n")


def _caller() -> str:
    for frame in inspect.stack()[2:]:
        name = frame.filename
        if "/tests/" in name and not name.endswith(("tolerances.py", "conftest.py")):
            return f"{Path(name).name}:{frame.lineno}"
    return "?"


def assertion_passed(orig: str, expl: str, where: str) -> None:
    """pytest's pass hook: a comparison of two numbers on the explanation's first line."""
    first = expl.splitlines()[0] if expl else ""
    match = _COMPARE.match(first)
    if not match:
        return
    try:
        left, op, right = float(match.group(1)), match.group(2), float(match.group(3))
    except ValueError:
        return
    if left.is_integer() and right.is_integer():
        return  # (counts and sizes, not tolerances)
    upper = op in ("<", "<=")
    _write("assert", left, right, upper, f"{where}: {orig[:120]}")


def install() -> None:
    """Record every pytest.approx and torch.testing.assert_close comparison."""
    if RECORD is None:
        return
    from _pytest import approx as python_api

    original = python_api.ApproxScalar.__eq__

    def eq(self: Any, actual: Any) -> bool:
        same = original(self, actual)
        try:
            diff = abs(float(self.expected) - float(actual))
            _write("approx", diff, float(self.tolerance), True, _caller())
        except (TypeError, ValueError, OverflowError):
            pass
        return bool(same)

    python_api.ApproxScalar.__eq__ = eq  # type: ignore[method-assign]

    import torch

    close = torch.testing.assert_close

    def assert_close(actual: Any, expected: Any, *args: Any, **kwargs: Any) -> None:
        close(actual, expected, *args, **kwargs)
        rtol, atol = kwargs.get("rtol"), kwargs.get("atol")
        if isinstance(actual, torch.Tensor) and isinstance(expected, torch.Tensor) and rtol is not None \
                and atol is not None and actual.is_floating_point():
            diff = (actual.double() - expected.double()).abs()
            allowed = atol + rtol * expected.double().abs()
            worst = (diff / allowed).max().item() if diff.numel() else 0.0
            _write("assert_close", worst, 1.0, True, _caller())

    torch.testing.assert_close = assert_close


def report(path: str, within: float = 2.0) -> list[dict[str, Any]]:
    """The tightest record of each (test, where) whose ratio is below `within`."""
    tightest: dict[tuple[str, str], dict[str, Any]] = {}
    for line in Path(path).read_text().splitlines():
        rec = json.loads(line)
        key = (rec["test"], rec["where"])
        if key not in tightest or rec["ratio"] < tightest[key]["ratio"]:
            tightest[key] = rec
    return sorted((r for r in tightest.values() if r["ratio"] < within), key=lambda r: r["ratio"])


if __name__ == "__main__":
    for rec in report(sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 2.0):
        side = "<=" if rec["upper"] else ">="
        print(f"{rec['ratio']:7.2f}x  {rec['measured']:.3g} {side} {rec['bound']:.3g}  {rec['test']}  "
              f"{rec['where']}")
