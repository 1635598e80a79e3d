"""The planted faults (tests/planted.py) are wired: each names a guarantees.md row that exists
and a test that exists and plants it, so a fault cannot sit in the registry unused."""

from __future__ import annotations

import ast
import re
from collections.abc import Callable
from pathlib import Path

import planted

ROOT = Path(__file__).resolve().parents[2]


def _test_function(spec: str) -> ast.FunctionDef:
    path, name = spec.split("::")
    tree = ast.parse((ROOT / path).read_text())
    found = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name]
    assert found, f"{spec}: no such test"
    return found[0]


def test_every_fault_names_a_row_and_a_test_that_plants_it() -> None:
    rows = (ROOT / "docs" / "guarantees.md").read_text()
    assert planted.FAULTS
    for f in planted.FAULTS.values():
        for row in f.rows:
            assert any(row in first_cell(r) for r in promise_rows(rows)), \
                f"{f.name}: no guarantees.md row's first cell contains {row!r}"
        body = ast.unparse(_test_function(f.test))
        assert repr(f.name) in body or f'"{f.name}"' in body, f"{f.name}: {f.test} does not plant it"
        assert "caught(" in body, f"{f.name}: {f.test} never asserts that the check fails (caught)"
        assert "must=" in body, f"{f.name}: {f.test} never says what the check must find (caught's must=)"


def promise_rows(text: str) -> list[str]:
    """The rows of guarantees.md's tables: each `| ... |` line but the headers (a line followed by
    the |---| separator) and the separators."""
    lines = text.splitlines()
    rows = []
    for i, line in enumerate(lines):
        if not line.startswith("| ") or set(line.strip()) <= set("|- "):
            continue
        if i + 1 < len(lines) and set(lines[i + 1].strip()) <= set("|- ") and lines[i + 1].strip():
            continue  # a header
        rows.append(line)
    return rows


def first_cell(row: str) -> str:
    """A table row's first cell (what the row promises, and the test and fault it names)."""
    return row.strip().removeprefix("|").split(" | ", 1)[0].strip()


def uncovered(rows: list[str], names: list[str]) -> list[str]:
    """The rows whose first cell no fault names (a name elsewhere in a row does not count: a
    tolerance cell may quote another row's words)."""
    return [r[:100] for r in rows if not any(name in first_cell(r) for name in names)]


def test_every_guarantee_row_has_a_planted_fault() -> None:
    """Each promise keeps a test shown to fail on a planted fault: a row no fault names is one
    whose test nobody has seen fail."""
    rows = promise_rows((ROOT / "docs" / "guarantees.md").read_text())
    assert len(rows) > 90
    names = [row for f in planted.FAULTS.values() for row in f.rows]
    bare = uncovered(rows, names)
    assert not bare, f"{len(bare)} guarantee row(s) without a planted fault: {bare}"


def test_a_row_is_covered_by_its_first_cell_only() -> None:
    """A fault's name in another cell of a row (the words of another row's promise) does not
    cover it: the finetune_lora row once passed so, on its tolerance cell's "token-weighted loss"."""
    rows = ["| `examples/x.py` under launch | zero3 | runs with token-weighted loss |",
            "| token-weighted loss (`tests/test_token_loss.py`) | zero3 | 1e-5 |"]
    assert uncovered(rows, ["token-weighted loss"]) == [rows[0][:100]]
    assert first_cell("| a `b|c` d | e |") == "a `b|c` d"


def test_promise_rows_skip_headers_and_separators() -> None:
    table = "| a | b |\n|---|---|\n| one | 1 |\n| two | 2 |\n\ntext\n| c |\n|---|\n| three |\n"
    assert promise_rows(table) == ["| one | 1 |", "| two | 2 |", "| three |"]


def test_caught_refuses_a_check_that_passes() -> None:
    check_caught_refuses_a_pass()


def test_caught_refuses_a_crash_and_another_finding() -> None:
    check_caught_refuses_a_crash_and_another_finding()


def test_planted_caught_accepts_any_failure_is_caught() -> None:
    """`caught_accepts_any_failure`: `caught` takes a crash or another finding for the fault's;
    the check of `caught` itself fails (run by the real `caught`, taken before the fault)."""
    caught = planted.caught
    with planted.planted_here("caught_accepts_any_failure"):
        caught(check_caught_refuses_a_crash_and_another_finding, must="took a crash for a catch")


def check_caught_refuses_a_crash_and_another_finding() -> None:
    def crashed() -> None:  # spawn's
        raise AssertionError("the run failed: worker failed:\nTraceback (most recent call last):\n  ...")

    def other() -> None:
        raise AssertionError("weights differ by 2e-1 (an unrelated regression)")

    def errs() -> None:
        raise RuntimeError("worker failed: boom")

    assert planted.caught(other, must=r"weights differ") == "weights differ by 2e-1 (an unrelated regression)"
    _refused(lambda: planted.caught(crashed, must="failed"), "took a crash for a catch")
    _refused(lambda: planted.caught(other, must=r"losses differ"), "took another finding for the fault's")
    try:
        planted.caught(errs, must="boom")
    except RuntimeError:
        pass
    else:
        raise AssertionError("caught() took a worker's error for a catch")


def _refused(call: Callable[[], object], why: str) -> None:
    """`call` (a `caught`) refuses what its check gave: an AssertionError, not "went unnoticed"."""
    try:
        call()
    except AssertionError as err:
        assert "went unnoticed" not in str(err), err
    else:
        raise AssertionError(f"caught() {why}")


def test_planted_caught_accepts_a_pass_is_caught() -> None:
    """`caught_accepts_a_pass`: `caught` no longer fails on a check that passes; the check of
    `caught` itself fails (run by the real `caught`, taken before the fault)."""
    caught = planted.caught
    with planted.planted_here("caught_accepts_a_pass"):
        assert "went unnoticed" not in caught(check_caught_refuses_a_pass,
                                              must=r"^caught\(\) accepted a check that passed")


def check_caught_refuses_a_pass() -> None:
    def passes() -> None:
        pass

    def fails() -> None:
        raise AssertionError("losses differ by 3e-2")

    assert planted.caught(fails, must=r"losses differ") == "losses differ by 3e-2"
    try:
        planted.caught(passes, must=r"losses differ")
    except AssertionError as err:
        assert "went unnoticed" in str(err)
    else:
        raise AssertionError("caught() accepted a check that passed")


# patterns any failure of any check would match: a `must` that says nothing of the finding
GENERIC = {"", ".*", ".+", "assert", "AssertionError", "Error"}


def _must_patterns(node: ast.expr) -> list[str] | None:
    """The pattern(s) a `must=` argument spells, as far as the source says: a string, the string
    parts of an f-string, or the strings of a concatenation (None: not a string at all)."""
    if isinstance(node, ast.Constant):
        return [node.value] if isinstance(node.value, str) else None
    if isinstance(node, ast.JoinedStr):
        return ["".join(v.value for v in node.values if isinstance(v, ast.Constant)) + "{...}"]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _must_patterns(node.left), _must_patterns(node.right)
        return None if left is None or right is None else ["".join(left + right)]
    return None


def _bare(pattern: str) -> str:
    """A pattern without its anchors and flags: `^(?s).*$` is `.*`."""
    core = re.sub(r"^(\(\?[aiLmsux]+\))*\^?", "", pattern)
    return core.removesuffix("$").strip()


def test_every_caught_says_what_its_check_must_find() -> None:
    """Each `caught(...)` in tests/ passes `must=`: a regular expression (a string, an f-string or
    a concatenation of strings) naming what the fault makes the check find, not one any failure
    matches. A planted test whose check fails on another finding, or on a crash, passes nothing."""
    calls, wrong = 0, []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
            if name != "caught":
                continue
            calls += 1
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            must = next((k.value for k in node.keywords if k.arg == "must"), None)
            patterns = None if must is None else _must_patterns(must)
            if patterns is None:
                wrong.append(f"{where}: no must= string ({ast.unparse(must) if must else 'absent'})")
            elif any(_bare(p) in GENERIC for p in patterns):
                wrong.append(f"{where}: must={ast.unparse(must)} matches any failure")
    assert calls > 100, calls  # (the walk found the planted tests)
    assert not wrong, "\n".join(wrong)


def test_a_must_that_says_nothing_is_refused() -> None:
    def patterns(source: str) -> list[str] | None:
        return _must_patterns(ast.parse(source, mode="eval").body)

    assert patterns("r'^a (b)'") == ["^a (b)"] and patterns("'a' 'b'") == ["ab"]
    assert patterns("r'x' + r'y'") == ["xy"] and patterns("f'{case}: y'") == [": y{...}"]
    assert patterns("None") is None and patterns("must") is None and patterns("'a' + must") is None
    bare = [_bare(p) for p in ("^.*$", "(?s)^.+", "assert", " ", "^Error")]
    assert bare == [".*", ".+", "assert", "", "Error"] and all(b in GENERIC for b in bare)
    assert _bare(r"^rank 1 did not skip") not in GENERIC
