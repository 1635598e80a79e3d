"""The demo and the benchmark run end to end under the real launcher (torchrun, 2 processes)."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

from spawn import run_command

ROOT = Path(__file__).resolve().parents[1]


def _torchrun(*args: str) -> str:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args]
    proc = run_command(cmd, cwd=ROOT, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_demo_trains_under_zero3_and_reports_memory(tmp_path: Path) -> None:
    out = _torchrun("examples/demo.py", "--steps", "20", "--run-dir", str(tmp_path))
    losses = [float(x) for x in re.findall(r"step +\d+  loss (\d+\.\d+)", out)]
    assert len(losses) == 2 and losses[1] < losses[0] - 0.3, out
    held = re.findall(r"rank (\d) holds: params ([\d.]+) MiB", out)
    assert sorted(r for r, _ in held) == ["0", "1"]
    full = float(re.search(r"would hold ([\d.]+) MiB", out).group(1))
    assert all(abs(float(mib) - full / 2) / full < 0.05 for _, mib in held)
    assert "tokens/s" in out
    # it ends with the run's report: the summary, and the PNG next to the metrics
    assert "20 steps, 2 records" in out
    assert (tmp_path / "logs" / "demo" / "report.png").stat().st_size > 10_000


def test_compare_benchmark_runs_and_reports_what_ran(tmp_path: Path) -> None:
    out = _torchrun("benchmarks/compare.py", "--strategies", "zero3", "--peers", "shardwise", "raw",
                    "--steps", "3", "--warmup", "1", "--out", str(tmp_path))
    (report,) = tmp_path.glob("compare-*.json")
    rows = json.loads(report.read_text())["rows"]
    assert [r["peer"] for r in rows] == ["shardwise", "raw"]
    assert all(r["weights_agree_across_ranks"] and r["tokens_per_s"] > 0 for r in rows)
    assert rows[0]["final_loss"] == rows[1]["final_loss"]  # the same training, to the bit
    assert rows[0]["state_mib"] == rows[1]["state_mib"]  # same parameters, gradients, optimizer state
    assert "| zero3 | shardwise |" in out and any(tmp_path.glob("compare-*.md"))
