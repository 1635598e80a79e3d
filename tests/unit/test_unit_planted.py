"""The planted faults (tests/planted.py) are wired: each names a guarantees.md row that exists
and a test that exists and plants it, so a fault cannot sit in the registry unused."""

from __future__ import annotations

import ast
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
            assert row in rows, f"{f.name}: no guarantees.md row contains {row!r}"
        body = ast.unparse(_test_function(f.test))
        assert repr(f.name) in body or f'"{f.name}"' in body, f"{f.name}: {f.test} does not plant it"
        assert "caught(" in body, f"{f.name}: {f.test} never asserts that the check fails (caught)"


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


def test_every_guarantee_row_has_a_planted_fault() -> None:
    """Each promise keeps a test shown to fail on a planted fault: a row no fault names is one
    whose test nobody has seen fail."""
    rows = promise_rows((ROOT / "docs" / "guarantees.md").read_text())
    assert len(rows) > 90
    names = [row for f in planted.FAULTS.values() for row in f.rows]
    bare = [r[:100] for r in rows if not any(name in r for name in names)]
    assert not bare, f"{len(bare)} guarantee row(s) without a planted fault: {bare}"


def test_promise_rows_skip_headers_and_separators() -> None:
    table = "| a | b |\n|---|---|\n| one | 1 |\n| two | 2 |\n\ntext\n| c |\n|---|\n| three |\n"
    assert promise_rows(table) == ["| one | 1 |", "| two | 2 |", "| three |"]


def test_caught_refuses_a_check_that_passes() -> None:
    check_caught_refuses_a_pass()


def test_planted_caught_accepts_a_pass_is_caught() -> None:
    """`caught_accepts_a_pass`: `caught` no longer fails on a check that passes; the check of
    `caught` itself fails (run by the real `caught`, taken before the fault)."""
    caught = planted.caught
    with planted.planted_here("caught_accepts_a_pass"):
        assert "went unnoticed" not in caught(check_caught_refuses_a_pass)


def check_caught_refuses_a_pass() -> None:
    def passes() -> None:
        pass

    def fails() -> None:
        raise AssertionError("losses differ by 3e-2")

    assert planted.caught(fails) == "losses differ by 3e-2"
    try:
        planted.caught(passes)
    except AssertionError as err:
        assert "went unnoticed" in str(err)
    else:
        raise AssertionError("caught() accepted a check that passed")
