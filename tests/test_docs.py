"""The README and docs/ stay true to the code: the generated config page is current, every Python
block compiles, every relative link (and its #anchor) lands. Fast: no process is spawned."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
from planted import caught, planted_here

from shardwise.config import docs
from shardwise.config.docs import REGENERATE

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# a fenced block, also indented under a list item (closed at the same indent)
FENCE = re.compile(r"^([ \t]*)```(\w*)[^\n]*\n(.*?)^\1```", re.MULTILINE | re.DOTALL)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT))


def _prose(text: str) -> str:
    """The page without its fenced blocks (a `[x](y)` inside code is no link)."""
    return FENCE.sub("", text)


def _anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens."""
    out = set()
    for heading in re.findall(r"^#+ (.+)$", _prose(text), re.MULTILINE):
        out.add(re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-"))
    return out


def test_config_reference_is_current() -> None:
    check_reference_current(docs.config_reference())


def check_reference_current(text: str) -> None:
    page = ROOT / "docs" / "config.md"
    assert page.exists(), f"docs/config.md is missing: run `{REGENERATE}` (or `make docs`)"
    assert page.read_text() == text, (
        f"docs/config.md is stale against src/shardwise/config/tree.py: run `{REGENERATE}` (or `make docs`)"
    )


def test_config_reference_documents_every_field() -> None:
    check_every_field(docs.config_reference())


def test_planted_field_docs_dropped_is_caught() -> None:
    """`field_docs_dropped`: the generator loses most fields' docstrings; the page no longer
    matches and rows go without a description."""
    with planted_here("field_docs_dropped"):
        text = docs.config_reference()
    caught(check_reference_current, text,
           must=r"^docs/config\.md is stale against src/shardwise/config/tree\.py")
    caught(check_every_field, text, must=r"^\d+ of \d+ rows without a description: ")


def check_every_field(text: str) -> None:
    for key in ("`sharding.strategy`", "`strategy`", "`grad_accum_steps`", "`launch.num_processes`",
                "`sharding.loss_scale.init_scale`", "`parallelism.tp`", "`checkpointing.dir`",
                "`optimizer.lr`", "`scheduler.warmup_type`", "`host_kernel`"):
        assert key in text
    # every row carries its docstring: no field may be left without one
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    bare = [line for line in rows if line.rstrip().endswith("|  |")]
    assert rows and not bare, f"{len(bare)} of {len(rows)} rows without a description: {bare[:3]}"


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_python_blocks_compile(page: Path) -> None:
    blocks = [textwrap.dedent(body) for _, lang, body in FENCE.findall(page.read_text()) if lang == "python"]
    for i, body in enumerate(blocks):
        compile(body, f"{_name(page)} python block {i + 1}", "exec")


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_relative_links_resolve(page: Path) -> None:
    text = page.read_text()
    for target in LINK.findall(_prose(text)):
        if re.match(r"^[a-z]+:", target):
            continue  # http(s), mailto: not checked offline
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        assert dest.exists(), f"{_name(page)}: link {target!r} points to a missing file"
        if anchor and dest.suffix == ".md":
            assert anchor in _anchors(dest.read_text()), (
                f"{_name(page)}: link {target!r}: no heading #{anchor}"
            )


def test_pages_were_found() -> None:
    # the README and the pages it links to; an empty glob would make the tests above prove nothing
    names = {_name(p) for p in PAGES}
    assert {"README.md", "docs/config.md", "docs/api.md", "docs/guarantees.md"} <= names
