"""The faults of tests/test_resilience.py under N-D layouts, under `shardwise launch`: dp 2 x tp 2
under zero3 (4 processes) and tp 2 with sequence_parallel under zero3 (2 processes), the tiny
Llama on its own tensor-parallel plan (tests/scripts/resilient.py picks it when the config sets
tensor_parallel_size), checkpoint_every_steps 2, 8 steps of a global batch of 4.

One chain of faults per layout, each fault a launch of its own on the same checkpoint folder:
  1. SIGTERM to `shardwise launch` and every worker at once after step 3 (slowed down): the
     workers save at the next boundary and exit 75, the launcher names the saved step (3, 4 or 5);
  2. a relaunch resumes from it; process 1's files may not grow from step 6 on (a file-size
     limit: the kernel's EFBIG, as a full disk): the save of step 6 fails with the same one line
     ("could not ...: File too large ...") on every process, the run ends 1, and the newest
     checkpoint is still the one before, whole (`verify`);
  3. a relaunch resumes from it; process 0 (the one that commits a checkpoint) is SIGKILLed in
     the middle of saving step 6, its tensors written and the checkpoint not committed, as a
     node lost mid-write: the run ends non-zero, the newest checkpoint is still the one before
     (whole, `verify`), what the lost save left is a hidden `.step_6.incomplete`;
  4. a relaunch with `--max-restarts 1` resumes from that checkpoint; a worker SIGKILLs itself
     after step 7; torchrun restarts the group, which resumes from step 6 and finishes.
Every loss any attempt logged (each step's, recomputed ones included) equals the uninterrupted
run's of the same layout bit for bit (fp32), and the final weights are torch.equal to its.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
from planted import caught
from test_resilience import _config, _identical, _result, _run, _signalled, check_stop

LAYOUTS = {
    "dp2xtp2_zero3": {"strategy": "zero3", "tensor_parallel_size": 2, "launch": {"num_processes": 4}},
    "tp2_sp_zero3": {"strategy": "zero3", "tensor_parallel_size": 2, "sequence_parallel": True},
}


def _saved_steps(folder: Path) -> list[int]:
    return sorted(int(p.name.split("_")[1]) for p in (folder / "checkpoints").glob("step_*"))


def _sigterm_everyone(config: Path, folder: Path, processes: int) -> int:
    """Launch slowed down, SIGTERM the launcher and every worker at once after step 3; check what
    the stop left (`test_resilience.check_stop`); the step the workers saved."""
    return check_stop(folder, "everyone", *_signalled(folder, config, "everyone", processes=processes,
                                                       timeout=120))


def _disk_full(config: Path, folder: Path, processes: int, saved: int) -> int:
    """A relaunch that resumes from `saved`, its save of step 6 failing on a full disk of process 1;
    the newest checkpoint left (the one before, whole)."""
    from shardwise.checkpoint.sharded import newest, verify

    run = _run(config, folder, fault="full:6:1", timeout=240)
    assert run.returncode == 1, run.stderr[-3000:]
    assert f"attempt 0: starting at step {saved}" in run.stdout, (run.stdout[-2000:], run.stderr[-3000:])
    said = [ln for ln in run.stderr.splitlines() if "File too large" in ln]
    # each process raises the same one line, naming the checkpoint and the bytes it needs
    lines = {ln.split("CheckpointError: ", 1)[1] for ln in said if "CheckpointError: " in ln
             and not ln.startswith("shardwise launch:")}
    assert len(lines) == 1, said
    line = lines.pop()
    assert line.startswith(f"{folder / 'checkpoints' / 'step_6'}: could not "), line
    assert "File too large" in line and "it needs " in line, line
    ranks = {r for r in range(processes) if any(f"[rank{r}]" in ln and line in ln for ln in said)}
    assert ranks == set(range(processes)), said
    previous = max(saved, 4)  # the policy saved step 4 unless the stop's checkpoint is step 5
    assert newest(folder / "checkpoints") == folder / "checkpoints" / f"step_{previous}"
    assert verify(folder / "checkpoints" / f"step_{previous}")
    assert 6 not in _saved_steps(folder)
    print(f"the full disk, on each of {processes} processes: {line}")
    return previous


def _lost_mid_write(config: Path, folder: Path, previous: int) -> None:
    """Process 0 SIGKILLed in the middle of saving step 6 (a node lost mid-write)."""
    from shardwise.checkpoint.sharded import newest, verify

    run = _run(config, folder, fault="lostsave:6:0", timeout=240)
    assert run.returncode != 0, run.stderr[-3000:]
    assert f"attempt 0: starting at step {previous}" in run.stdout, run.stdout[-3000:]
    root = folder / "checkpoints"
    assert (root / ".step_6.incomplete").is_dir() and not (root / "step_6").exists(), os.listdir(root)
    assert newest(root).name == f"step_{previous}" == (root / "latest").read_text().strip()
    assert len(verify(root)) >= 5  # every file of the newest checkpoint matches its checksum


def _every_loss(folder: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (folder / "losses.jsonl").read_text().splitlines()]


def check_every_loss(faulted: Path, ref_losses: dict[int, float], ref_state: dict[str, Any]) -> list[Any]:
    """Every loss any attempt logged, and the final weights, bit for bit the uninterrupted run's."""
    rows = _every_loss(faulted)
    assert {r["step"] for r in rows} == set(range(1, 9))
    wrong = [(r["step"], r["loss"], ref_losses[r["step"]]) for r in rows
             if r["loss"] != ref_losses[r["step"]]]
    assert not wrong, f"(step, loss, the uninterrupted run's): {wrong}"  # bit for bit (fp32)
    losses, state = _result(faulted)
    assert losses == ref_losses and _identical(state, ref_state)
    return rows


def test_planted_resume_counts_processes_is_caught(tmp_path: Path) -> None:
    """`resume_counts_processes`: a resumed DataLoader's position scaled from the data-parallel
    ranks to the processes (under tp 2, twice as far); tp 2 with sequence parallelism stopped by
    SIGTERM and resumed: the resumed steps' losses leave the uninterrupted run's."""
    settings = LAYOUTS["tp2_sp_zero3"]
    straight, faulted = tmp_path / "straight", tmp_path / "faulted"
    straight.mkdir()
    faulted.mkdir()
    ref = _run(_config(straight, checkpoint_every_steps=2, **settings), straight)
    assert ref.returncode == 0, ref.stderr[-3000:]
    config = _config(faulted, checkpoint_every_steps=2, **settings)
    _sigterm_everyone(config, faulted, 2)
    run = _run(config, faulted, planted_fault="resume_counts_processes", timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    caught(check_every_loss, faulted, *_result(straight),
           must=r"^\(step, loss, the uninterrupted run's\): \[\(\d+, ")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_n_d_layouts_survive_sigterm_a_full_disk_a_lost_write_and_a_killed_worker(layout: str,
                                                                                  tmp_path: Path) -> None:
    settings = LAYOUTS[layout]
    processes = settings.get("launch", {}).get("num_processes", 2)
    straight, faulted = tmp_path / "straight", tmp_path / "faulted"
    straight.mkdir()
    faulted.mkdir()
    t0 = time.monotonic()
    ref = _run(_config(straight, checkpoint_every_steps=2, **settings), straight)
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert "auto chose" not in ref.stderr
    ref_losses, ref_state = _result(straight)
    assert list(ref_losses) == list(range(1, 9))
    config = _config(faulted, checkpoint_every_steps=2, **settings)

    saved = _sigterm_everyone(config, faulted, processes)
    previous = _disk_full(config, faulted, processes, saved)
    _lost_mid_write(config, faulted, previous)
    run = _run(config, faulted, "--max-restarts", "1", fault="kill:7:1", timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    log = run.stdout + run.stderr
    assert f"attempt 0: starting at step {previous}" in log, log[-3000:]
    assert "attempt 1: starting at step 6" in log, log[-3000:]
    assert "the worker group was restarted (1 restart(s) so far)" in log

    rows = check_every_loss(faulted, ref_losses, ref_state)
    print(f"{layout}: SIGTERM saved step {saved}, the full disk and the lost write kept step {previous}, the "
          "killed worker's "
          f"restart resumed step 6: {len(rows)} losses and the final weights bit-identical "
          f"({time.monotonic() - t0:.0f} s)")
