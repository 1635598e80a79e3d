"""The engine's seams, in one process: the step boundary's ordered hooks
(`shardwise.engine.boundary`), the checkpoint manager's naming, pruning and resume discovery
(`shardwise.checkpoint.naming`, `.manager`), the mesh's named dimensions
(`shardwise.distributed.mesh.ParallelDims`) and the config sections components receive."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from shardwise.checkpoint.files import FORMAT, META
from shardwise.checkpoint.manager import CheckpointManager
from shardwise.checkpoint.naming import NumberedFolders, StepFolders
from shardwise.checkpoint.run_record import RUN_RECORD_ENV, append, read_run_record
from shardwise.checkpoint.storage import CheckpointError
from shardwise.config import EngineConfig
from shardwise.config.tree import (
    BlocksConfig,
    CheckpointConfig,
    ObservationConfig,
    SupervisionConfig,
)
from shardwise.distributed.mesh import ParallelDims
from shardwise.engine.boundary import StepBoundary


def _checkpoint(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / META).write_text(json.dumps({"format": FORMAT, "files": {}}))
    return folder


# -- the step boundary ---------------------------------------------------------------------------
def test_the_boundary_runs_its_hooks_in_order_once_per_step() -> None:
    seen: list[tuple[str, int]] = []
    b = StepBoundary()
    for name in ("observation", "supervision", "compile watch"):
        b.add(name, lambda step, name=name: seen.append((name, step)))
    assert b.reach(0) and not b.reach(0)  # idempotent in one place
    assert b.reach(1)
    assert seen == [("observation", 0), ("supervision", 0), ("compile watch", 0),
                    ("observation", 1), ("supervision", 1), ("compile watch", 1)]


def test_a_loaded_step_passes_its_boundary() -> None:
    seen: list[int] = []
    b = StepBoundary()
    b.add("supervision", seen.append)
    b.passed(7)  # load_state restored step 7: no checkpoint of it again
    assert not b.reach(7) and b.reach(8) and seen == [8]


# -- folder naming and pruning --------------------------------------------------------------------
def test_step_folders_name_find_and_prune(tmp_path: Path) -> None:
    naming = StepFolders(tmp_path, keep_last=2)
    assert naming.folder(4) == tmp_path / "step_4" and naming.newest() is None
    for step in (2, 4, 6):
        naming.placed(_checkpoint(naming.folder(step)), None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_4", "step_6"]
    assert naming.newest() == tmp_path / "step_6" and naming.has(4) and not naming.has(2)
    naming.placed(_checkpoint(naming.folder(8)), keep_last=1)  # a save's own keep_last wins
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_8"]


def test_accelerate_numbering_continues_after_earlier_runs_and_prunes_only_its_own(tmp_path: Path) -> None:
    project = SimpleNamespace(project_dir=str(tmp_path), iteration=0, total_limit=2)
    numbered = NumberedFolders(project)
    earlier = _checkpoint(numbered.folder(3))  # an earlier run's
    assert numbered.next_index() == 4  # never into an existing checkpoint_<i>
    drops = [numbered.saved(_checkpoint(numbered.folder(i))) for i in (4, 5, 6)]
    assert drops == [[], [], [numbered.folder(4)]] and project.iteration == 7
    assert all(earlier not in d for d in drops)
    fresh = NumberedFolders(SimpleNamespace(project_dir=str(tmp_path), iteration=0, total_limit=None))
    assert fresh.newest() == numbered.folder(6) and fresh.project.iteration == 7  # the next save goes past it


# -- resume discovery -------------------------------------------------------------------------------
def _manager(tmp_path: Path, resume: str) -> tuple[CheckpointManager, list[str]]:
    said: list[str] = []

    def no_group() -> Any:
        raise AssertionError("resume discovery makes no process group")

    section = CheckpointConfig(dir=str(tmp_path / "ckpt"), resume=resume)
    return CheckpointManager(section, rank=0, local_main=True, say=said.append, make_group=no_group), said


def test_resume_finds_the_newest_or_says_there_is_none(tmp_path: Path) -> None:
    manager, said = _manager(tmp_path, "auto")
    assert manager.resume_point() is None and "starting at step 0" in said[-1]
    _checkpoint(tmp_path / "ckpt" / "step_3")
    _checkpoint(tmp_path / "ckpt" / "step_10")
    assert manager.resume_point() == tmp_path / "ckpt" / "step_10"
    never, said = _manager(tmp_path, "never")
    assert never.resume_point() is None and said == [f"resume: never: no checkpoint loaded (checkpoint_dir "
                                                     f"{tmp_path / 'ckpt'}/); starting at step 0"]


def test_resume_required_and_an_earlier_attempts_checkpoint_gone(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    required, _ = _manager(tmp_path, "required")
    with pytest.raises(CheckpointError, match="resume: required"):
        required.resume_point()
    record = tmp_path / "run.jsonl"
    monkeypatch.setenv(RUN_RECORD_ENV, str(record))
    append(4, 1.5, path="/shared/ckpt/step_4")  # attempt 0 saved step 4 ...
    assert read_run_record(str(record))[0]["step"] == 4
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # ... and attempt 1 does not see it
    auto, _ = _manager(tmp_path, "auto")
    with pytest.raises(CheckpointError, match="restart 1: an earlier attempt saved /shared/ckpt/step_4"):
        auto.resume_point()


def test_a_step_is_saved_when_its_folder_is_there(tmp_path: Path) -> None:
    manager, _ = _manager(tmp_path, "auto")
    assert not manager.has_saved(5) and manager.newest_saved == (-1, "")
    _checkpoint(tmp_path / "ckpt" / "step_5")  # (a run resumed at its last step)
    assert manager.has_saved(5)


# -- the mesh's named dimensions -----------------------------------------------------------------
def _dims(world: int, *, shards: bool = True, **config: Any) -> ParallelDims:
    """The layout a strategy resolves from a config (`strategies.base.layout`), on a fake world."""
    import torch

    from shardwise.distributed.world import DistInfo
    from shardwise.strategies.base import Strategy, layout

    info = DistInfo(rank=0, world_size=world, local_rank=0, local_world_size=world,
                    device=torch.device("cpu"))
    return layout(EngineConfig.of(**config), info, shards=shards, supported=Strategy.supported_dims)


def test_parallel_dims_of_each_strategy_layout() -> None:
    ddp = _dims(8, shards=False)
    assert (ddp.dp_replicate, ddp.dp_shard, ddp.names) == (8, 1, ("dp_replicate",))
    full = _dims(8, strategy="zero3")
    assert (full.dp_replicate, full.dp_shard, full.names) == (1, 8, ("dp_shard",))
    hybrid = _dims(8, strategy="zero3", shard_group_size=4)
    assert hybrid.names == ("dp_replicate", "dp_shard") and hybrid.dp_size == 8
    assert (hybrid.dp_replicate, hybrid.dp_shard) == (2, 4)
    # the parallelism section says the same layout by its sizes
    assert _dims(8, strategy="zero3", parallelism={"dp_replicate": 2}) == hybrid
    assert _dims(8, strategy="zero3", parallelism={"dp_shard": 4, "dp_replicate": -1}) == hybrid
    assert [hybrid.dp_rank(r) for r in range(8)] == list(range(8))  # every dimension is data parallel
    with pytest.raises(ValueError, match="does not make the world of 8"):
        ParallelDims(3, 2, 8)


# -- config sections ----------------------------------------------------------------------------------
def test_components_get_their_own_section_from_the_flat_keys() -> None:
    cfg = EngineConfig.of(checkpoint_dir="ck", checkpoint_every_steps=5, keep_last=2, checkpoint_async=True,
                          resume="never", preempt_signals=("SIGUSR1",), preempt_grace_s=9.0,
                          collective_timeout_s=60.0)
    assert cfg.checkpointing == CheckpointConfig(dir="ck", every_steps=5, keep_last=2, background=True,
                                                 resume="never")
    assert cfg.supervision == SupervisionConfig(preempt_signals=("SIGUSR1",), preempt_grace_s=9.0,
                                                collective_timeout_s=60.0)
    cfg = EngineConfig.of(strategy="zero3", offload="optimizer", precision="bf16", shard_group_size="node",
                          wrap="Block", max_grad_norm=1.0, activation_checkpointing=True, compile=True,
                          compile_backend="aot_eager", log_with="jsonl", log_every_steps=3, project_dir="p",
                          tensor_parallel_size=2, context_parallel="ulysses")
    sharding = cfg.sharding
    assert (sharding.strategy, sharding.offload, sharding.precision, sharding.shard_group_size) == (
        "zero3", "optimizer", "bf16", "node")
    assert cfg.training.max_grad_norm == 1.0
    assert cfg.blocks == BlocksConfig(wrap=("Block",), activation_checkpointing="full", compile=True,
                                      compile_backend="aot_eager")
    assert cfg.observation == ObservationConfig(log_with=("jsonl",), log_every_steps=3, project_dir="p")
    assert (cfg.parallelism.tp, cfg.parallelism.cp_method) == (2, "ulysses")


# -- the boundary's agreement: issued without waiting, read one boundary later -----------------------
class _Work:
    def wait(self) -> bool:
        return True


def test_the_agreement_is_read_at_the_next_boundary_and_a_stale_due_is_dropped(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two processes (the other raising nothing): what this one raises at a boundary is decided
    on at the next one; a clock's `due` raised before the policy's save is not saved again."""
    import signal

    import torch

    from shardwise.distributed.world import DistInfo
    from shardwise.runtime import supervision as S

    issued: list[list[float]] = []

    def all_reduce(t: torch.Tensor, op: object = None, async_op: bool = False) -> _Work:
        issued.append(t.tolist())  # (MAX with a process that raised nothing: the same flags)
        return _Work()

    monkeypatch.setattr(S.dist, "all_reduce", all_reduce)
    info = DistInfo(rank=0, world_size=2, local_rank=0, local_world_size=2, device=torch.device("cpu"))
    sup = S.Supervisor(SupervisionConfig(preempt_signals=()), CheckpointConfig(every_seconds=1e9), info)
    assert sup.at_boundary(0, write_failed=False) == S.BoundaryDecision()
    monkeypatch.setattr(S.PROCESS, "preempted", int(signal.SIGUSR1))
    assert sup.at_boundary(1, write_failed=False).stop is None  # raised here, decided at the next
    assert sup.at_boundary(2, write_failed=False).stop == "SIGUSR1"
    assert [row[0] for row in issued] == [0.0, 1.0, 1.0]
    monkeypatch.setattr(S.PROCESS, "preempted", 0)
    monkeypatch.setattr(sup, "_time_due", lambda: True)
    assert sup.at_boundary(3, write_failed=False).save is None  # due raised at 3 ...
    assert sup.at_boundary(4, write_failed=False).save == "every seconds"  # ... saved at 4
    sup.saved_by_policy(4)
    monkeypatch.setattr(sup, "_time_due", lambda: False)
    assert sup.at_boundary(5, write_failed=False).save is None  # 4's own due: stale after the save
    assert sup.at_boundary(6, write_failed=True).failed is False
    assert sup.at_boundary(7, write_failed=False).failed is True
    assert sup.settle()[1] == 7 and sup.settle()[1] == -1
