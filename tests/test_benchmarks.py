"""The GPU capacity benchmark's search, and its CPU dry run (the GPU run itself needs a GPU)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


@pytest.mark.parametrize("limit", [1, 2, 3, 7, 8, 100, 511])
def test_largest_batch_search_finds_the_boundary(limit: int) -> None:
    from gpu_capacity import largest_batch

    tried: list[int] = []

    def fits(b: int) -> bool:
        tried.append(b)
        return b <= limit

    assert largest_batch(fits, 512) == limit
    assert len(tried) <= 2 * 10 + 2  # doubling plus bisection, not a linear scan


def test_largest_batch_when_nothing_fits_or_everything_does() -> None:
    from gpu_capacity import largest_batch

    assert largest_batch(lambda b: False, 64) == 0
    assert largest_batch(lambda b: True, 48) == 48


def test_gpu_capacity_dry_run_writes_one_json(tmp_path: Path) -> None:
    import gpu_capacity

    path = gpu_capacity.main(["--dry-run", "--models", "gpt2-tiny", "--budget-gb", "2",
                              "--max-batch", "16", "--timed-steps", "1", "--out", str(tmp_path)])
    data = json.loads(path.read_text())
    assert [p.name for p in tmp_path.iterdir()] == [path.name]
    rows = {r["strategy"]: r for r in data["rows"]}
    assert set(rows) == {"ddp", "zero2", "zero3"}
    assert all(1 <= r["max_batch"] < 16 and r["tokens_per_s"] > 0 for r in rows.values())
