"""The boundary's decisions and the checkpoint folders' names, in one process
(`shardwise.runtime.supervision.decide`, `shardwise.checkpoint.files`, Accelerate's naming in
`shardwise.accelerate.objects`), and the arrival check of a world of one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardwise.checkpoint.files import FORMAT, META, mark_latest, newest, resolve, step_dirs
from shardwise.checkpoint.naming import checkpoint_index, numbered_checkpoints
from shardwise.checkpoint.storage import CheckpointError
from shardwise.distributed.arrival import arrived_together
from shardwise.runtime.supervision import BoundaryDecision, decide

QUIET = {"stop": False, "gone": False, "due": False, "failed": False, "every": None, "signalled": "SIGTERM"}


def test_a_quiet_boundary_does_nothing() -> None:
    assert decide(5, **QUIET) == BoundaryDecision()


def test_the_step_policy_saves_every_n_steps_but_not_at_step_0() -> None:
    saves = [s for s in range(10) if decide(s, **{**QUIET, "every": 3}).save == "every step"]
    assert saves == [3, 6, 9]


def test_the_clock_policy_saves_when_due() -> None:
    assert decide(1, **{**QUIET, "due": True}).save == "every seconds"


def test_a_signal_stops_the_run_after_saving_and_names_it() -> None:
    d = decide(4, **{**QUIET, "stop": True, "signalled": "SIGUSR1 (preemption notice)", "every": 2})
    assert d.stop == "SIGUSR1 (preemption notice)" and d.save is None and not d.failed


def test_a_gone_launcher_stops_the_run() -> None:
    assert decide(4, **{**QUIET, "gone": True}).stop == "the launcher is gone"


def test_a_failed_background_write_is_raised_unless_the_run_stops_anyway() -> None:
    assert decide(2, **{**QUIET, "failed": True}).failed
    stopping = decide(2, **{**QUIET, "failed": True, "stop": True})
    assert stopping.stop == "SIGTERM" and not stopping.failed


def _checkpoint(root: Path, name: str) -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    (folder / META).write_text(json.dumps({"format": FORMAT, "files": {}}))
    return folder


def test_step_folders_sort_by_number_and_only_complete_ones_count(tmp_path: Path) -> None:
    for n in (10, 2, 1):
        _checkpoint(tmp_path, f"step_{n}")
    (tmp_path / "step_11").mkdir()  # a save that died before its meta file: not a checkpoint
    (tmp_path / "step_x").mkdir()
    assert [p.name for p in step_dirs(tmp_path)] == ["step_1", "step_2", "step_10"]
    assert newest(tmp_path) == tmp_path / "step_10"


def test_latest_names_the_newest_and_keep_last_prunes_the_oldest(tmp_path: Path) -> None:
    for n in (1, 2, 3):
        _checkpoint(tmp_path, f"step_{n}")
    mark_latest(tmp_path, tmp_path / "step_3", keep_last=2)
    assert (tmp_path / "latest").read_text().strip() == "step_3"
    assert [p.name for p in step_dirs(tmp_path)] == ["step_2", "step_3"]
    assert resolve(tmp_path / "latest") == tmp_path / "step_3" and resolve(tmp_path) == tmp_path / "step_3"


def test_a_folder_with_a_users_file_is_not_pruned(tmp_path: Path) -> None:
    old = _checkpoint(tmp_path, "step_1")
    (old / "notes.txt").write_text("mine")
    _checkpoint(tmp_path, "step_2")
    mark_latest(tmp_path, tmp_path / "step_2", keep_last=1)
    assert old.is_dir()


def test_latest_before_any_save_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no checkpoint has been completed yet"):
        resolve(tmp_path / "latest")
    assert newest(tmp_path / "missing") is None


def test_accelerates_numbered_checkpoints(tmp_path: Path) -> None:
    for name in ("checkpoint_10", "checkpoint_2", "checkpoint_x", "other"):
        (tmp_path / name).mkdir()
    found = numbered_checkpoints(tmp_path)
    assert [p.name for p in found] == ["checkpoint_2", "checkpoint_10"]
    assert [checkpoint_index(p) for p in found] == [2, 10]
    assert numbered_checkpoints(tmp_path / "missing") == []


def test_a_world_of_one_always_arrives_together() -> None:
    calls: dict[int, int] = {}
    assert arrived_together(calls, "save", 3, 1, True, 1.0, lambda: False)
