"""Accelerate's helpers around the `Accelerator` that its example scripts use, on 2 CPU processes
under zero3, against a single-process plain-PyTorch reference: `accelerate.logging.get_logger`,
the TensorBoard layout (`<logging_dir>/<run>`, the engine's tags apart from the user's), an
optimizer's own methods (schedule-free's `train()`/`eval()`), `profile()` with `ProfileKwargs`,
`model.no_sync()` on a sharded model, and `gradient_state.active_dataloader`."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import workloads as W
from planted import caught, planted
from spawn import spawn
from torch.utils.data import DataLoader

pytest.importorskip("accelerate")  # its logger and ProfileKwargs are what is under test
pytest.importorskip("tensorboard")

B, STEPS, LR = 2, 3, 0.05  # per-process batch, optimizer steps (2 micro-batches each), SGD's lr


class _TrainEvalSGD(torch.optim.SGD):
    """SGD with schedule-free's shape of API: `eval()` moves the parameters it steps to another
    point (here: halves them), `train()` moves them back."""

    def eval(self) -> None:
        with torch.no_grad():
            for group in self.param_groups:
                for p in group["params"]:
                    p.mul_(0.5)

    def train(self) -> None:
        with torch.no_grad():
            for group in self.param_groups:
                for p in group["params"]:
                    p.mul_(2.0)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _extras_run(out: str) -> dict[str, Any]:
    from accelerate.logging import get_logger  # before the Accelerator, as scripts do
    from accelerate.utils import ProfileKwargs

    import shardwise

    logger = get_logger("sw_extras", log_level="INFO")
    records = _Records()
    logger.logger.addHandler(records)
    logger.logger.propagate = False
    acc = shardwise.Accelerator(cpu=True, strategy="zero3", project_dir=out, log_with="tensorboard",
                                log_every_steps=1, progress=False,
                                kwargs_handlers=[ProfileKwargs(output_trace_dir=str(Path(out) / "traces"))])
    logger.info("main only")
    logger.info("every process", main_process_only=False)
    acc.init_trackers("run")
    model = W.build("tiny")
    opt = _TrainEvalSGD(model.parameters(), lr=LR)
    loader = DataLoader(W.Tokens(acc.num_processes * B * 2 * STEPS), batch_size=B)
    model, opt, loader = acc.prepare(model, opt, loader)
    res: dict[str, Any] = {"pid": os.getpid(), "active": [], "synced_inside": []}
    with acc.profile() as prof:
        for k, ids in enumerate(loader):
            res["active"].append(acc.gradient_state.active_dataloader is loader)
            if k % 2 == 0:  # the autoregressive example's micro-batch: no communication
                with model.no_sync():
                    acc.backward(W.lm_loss(model, ids))
                res["synced_inside"].append(any(p.grad is not None for p in model.parameters()))
            else:
                acc.backward(W.lm_loss(model, ids))
                res["synced_after"] = all(p.grad is not None for p in model.parameters())  # reduced here
                opt.step()
                opt.zero_grad()
                acc.log({"epoch": k // 2}, step=k // 2)
    res["active_after"] = acc.gradient_state.active_dataloader
    res["profiled_ops"] = len(prof.key_averages())
    opt.eval()
    res["eval"] = acc.get_state_dict(model)
    opt.train()
    res["train"] = acc.get_state_dict(model)
    acc.end_training()
    res["log"] = records.lines
    return res


def _reference() -> dict[str, torch.Tensor]:
    """One process, global batches of 2*B: each optimizer step's gradient is the sum of its two
    micro-batches' global means (the micro-batches' gradients add up, processes average)."""
    model = W.build("tiny")
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    data = DataLoader(W.Tokens(2 * B * 2 * STEPS), batch_size=2 * B)
    batches = list(data)
    for s in range(STEPS):
        (W.lm_loss(model, batches[2 * s]) + W.lm_loss(model, batches[2 * s + 1])).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_accelerate_logger_tensorboard_layout_profile_no_sync_optimizer_methods(tmp_path: Path) -> None:
    check_extras(*spawn(_extras_run, 2, str(tmp_path)), tmp_path)


def test_a_no_sync_that_reduces_anyway_is_caught(tmp_path: Path) -> None:
    caught(check_extras, *spawn(planted(_extras_run, "no_sync_reduces"), 2, str(tmp_path)), tmp_path,
           must=r"reduced inside model\.no_sync\(\) at each step: \[True, True, True\]")


def check_extras(r0: dict[str, Any], r1: dict[str, Any], tmp_path: Path) -> None:
    # accelerate.logging: the main process alone by default, every process with its own rank
    assert r0["log"] == ["[RANK 0] main only", "[RANK 0] every process"]
    assert r1["log"] == ["[RANK 1] every process"]
    # model.no_sync() under zero3: nothing reduced inside, and the steps equal the reference's
    assert r0["synced_inside"] == r1["synced_inside"] == [False] * STEPS, \
        f"reduced inside model.no_sync() at each step: {r0['synced_inside']}, {r1['synced_inside']}"
    assert r0["synced_after"] and r1["synced_after"]
    ref = _reference()
    assert W.max_diff(r0["train"], ref) < 1e-5
    # the optimizer's own eval()/train() act on the sharded parameters it steps
    assert W.max_diff(r0["eval"], {k: v * 0.5 for k, v in ref.items()}) < 1e-5
    # gradient_state.active_dataloader: the loader during its pass, None after it
    assert r0["active"] == r1["active"] == [True] * (2 * STEPS)
    assert r0["active_after"] is None and r1["active_after"] is None
    # profile(): a Chrome trace per process, written by that process
    assert r0["profiled_ops"] > 0
    for rank, r in enumerate((r0, r1)):
        trace = json.loads((tmp_path / "traces" / f"profile_{rank}.json").read_text())
        assert r["pid"] in {e.get("pid") for e in trace["traceEvents"]}
        assert any(str(e.get("name", "")).startswith("aten::") for e in trace["traceEvents"])
    # TensorBoard: Accelerate's <project_dir>/<run>; the user's tag holds the user's 3 points only
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert not (tmp_path / "logs").exists()
    events = EventAccumulator(str(tmp_path / "run"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("epoch")] == [(0, 0.0), (1, 1.0), (2, 2.0)]
    assert len(events.Scalars("shardwise/loss")) >= STEPS  # the engine's records, under their own prefix


def test_logging_dir_of_project_configuration_holds_the_runs(tmp_path: Path) -> None:
    """ProjectConfiguration(logging_dir=...) decides where the runs go (as Accelerate); without
    it, the project folder does."""
    from accelerate.state import PartialState

    import shardwise

    pc = shardwise.ProjectConfiguration(project_dir=str(tmp_path / "p"), logging_dir=str(tmp_path / "l"))
    try:
        acc = shardwise.Accelerator(cpu=True, project_config=pc, log_with="jsonl")
        acc.init_trackers("r")
        acc.log({"x": 1.0}, step=0)
        acc.end_training()
        assert PartialState().num_processes == 1 and PartialState().is_main_process
    finally:
        _forget_accelerate_state()
    assert acc.logging_dir == str(tmp_path / "l")
    assert json.loads((tmp_path / "l" / "r" / "metrics.jsonl").read_text())["x"] == 1.0
    assert not list(tmp_path.rglob("logs"))


def _forget_accelerate_state() -> None:
    """Accelerate's shared states as shardwise filled them in this test process: cleared, so no
    other test sees them."""
    from accelerate.state import AcceleratorState, PartialState

    PartialState._shared_state.clear()
    AcceleratorState._shared_state.clear()


def test_accelerate_helpers_that_read_accelerator_state_work() -> None:
    """Accelerate's helpers that build `AcceleratorState()` (which refuses to be built but by
    Accelerate's own Accelerator) find shardwise's: `set_seed(seed, device_specific=True)`, as
    TRL's GRPOTrainer calls it, adds this process's index; the state holds no engine plugin."""
    from accelerate.state import AcceleratorState
    from accelerate.utils import set_seed

    import shardwise

    try:
        acc = shardwise.Accelerator(cpu=True, mixed_precision="bf16")
        state = AcceleratorState()
        assert (state.process_index, state.num_processes, state.mixed_precision) == (0, 1, "bf16")
        assert state.deepspeed_plugin is None and state.fsdp_plugin is None
        set_seed(3, device_specific=True)  # seed 3 + process 0
        drawn = torch.rand(2)
        torch.manual_seed(3)
        assert torch.equal(drawn, torch.rand(2))
        acc.end_training()
    finally:
        _forget_accelerate_state()


@pytest.fixture(scope="module")
def extras_reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """by_feature_extras.py under Accelerate itself: its folder and results."""
    from test_accelerate_scripts import HERE, _run

    tmp = tmp_path_factory.mktemp("extras")
    ref = _run(HERE / "by_feature_extras.py", tmp, "accelerate", None, reference=True)
    assert ref["event_dirs"] == ["extras"] and ref["traces"] == ["profile_0.json", "profile_1.json"]
    assert ref["epoch"] == [[0, 0.0], [1, 1.0], [2, 2.0], [3, 3.0]]
    return tmp, ref


def test_by_feature_extras_script_gives_accelerates_numbers_and_layout(
        extras_reference: tuple[Path, dict[str, Any]]) -> None:
    """tests/accelerate_scripts/by_feature_extras.py (tracking, profiler, schedule_free,
    autoregressive accumulation with model.no_sync, get_logger) under Accelerate itself, and with
    only its import changed under ddp and zero3, 2 processes each."""
    from test_accelerate_scripts import _run, _swapped

    tmp_path, ref = extras_reference
    ours = _swapped("by_feature_extras.py", tmp_path)
    for strategy in ("ddp", "zero3"):
        check_by_feature(tmp_path, strategy, ref, _run(ours, tmp_path, strategy, f"strategy: {strategy}\n"))
    assert json.loads((tmp_path / "accelerate" / "log_1.json").read_text()) == ["[RANK 1] everyone 1"]


def test_planted_traces_of_one_name_is_caught(extras_reference: tuple[Path, dict[str, Any]]) -> None:
    """`traces_of_one_name`: every process writes its profiler trace as profile_0.json; the
    check wants Accelerate's one file per process."""
    from planted import caught, fault_env
    from test_accelerate_scripts import _run, _swapped

    tmp_path, ref = extras_reference
    ours = _swapped("by_feature_extras.py", tmp_path)
    got = _run(ours, tmp_path, "planted", "strategy: zero3\n", env=fault_env("traces_of_one_name"))
    caught(check_by_feature, tmp_path, "planted", ref, got, must=r"\('planted', 'traces'\)")


def check_by_feature(tmp_path: Path, strategy: str, ref: dict[str, Any], got: dict[str, Any]) -> None:
    """One run of the swapped script against Accelerate's: losses, weight sums, the loader flags,
    the trace and event files, the tracked points, each process's logger lines."""
    tol = 1e-5 if strategy == "ddp" else 1e-4
    worst = max(abs(a - b) for a, b in zip(got["losses"], ref["losses"], strict=True))
    assert worst <= tol, f"{strategy}: losses differ from Accelerate's by {worst:.2e}"
    assert got["train_weights"] == pytest.approx(ref["train_weights"], rel=tol)
    assert got["eval_weights"] == pytest.approx(ref["eval_weights"], rel=tol)
    for key in ("active", "active_after", "traces", "event_dirs", "epoch"):
        assert got[key] == ref[key], (strategy, key)
    for rank in (0, 1):
        logged = json.loads((tmp_path / strategy / f"log_{rank}.json").read_text())
        assert logged == json.loads((tmp_path / "accelerate" / f"log_{rank}.json").read_text())


def test_parallelism_config_becomes_the_parallelism_section() -> None:
    """Accelerate's ParallelismConfig reaches the engine as its `parallelism` section (the sizes
    by their own names), which resolves to the layout Accelerate means, or is refused in one
    line; it is never dropped."""
    import torch
    from accelerate import ParallelismConfig

    from shardwise.accelerate.rules import read_parallelism
    from shardwise.config import ConfigError, EngineConfig
    from shardwise.distributed.world import DistInfo
    from shardwise.strategies.base import Strategy, layout

    def resolved(kwargs: dict[str, object]) -> tuple[int, int, int]:
        info = DistInfo(rank=0, world_size=4, local_rank=0, local_world_size=4, device=torch.device("cpu"))
        cfg = EngineConfig.of(strategy="zero3", **kwargs)  # type: ignore[arg-type]
        dims = layout(cfg, info, shards=True, supported=Strategy.supported_dims)
        return dims.dp_replicate, dims.dp_shard, dims.tp

    hybrid = ParallelismConfig(dp_replicate_size=2, dp_shard_size=2)
    kwargs: dict[str, object] = {"parallelism_config": hybrid}
    read_parallelism(kwargs, 4)
    assert kwargs == {"parallelism": {"dp_replicate": 2, "dp_shard": 2}}  # (tp_size 1: not written)
    assert resolved(kwargs) == (2, 2, 1)  # hybrid sharding: groups of 2
    kwargs = {"parallelism_config": ParallelismConfig(dp_shard_size=4)}
    read_parallelism(kwargs, 4)
    assert resolved(kwargs) == (1, 4, 1)  # one group of all
    kwargs = {"parallelism_config": ParallelismConfig(dp_shard_size=2, tp_size=2)}
    read_parallelism(kwargs, 4)
    assert resolved(kwargs) == (1, 2, 2)  # 2 dp ranks x tp 2
    for bad, world in ((ParallelismConfig(dp_replicate_size=2, dp_shard_size=2), 2),
                       (ParallelismConfig(dp_shard_size=2, tp_size=2), 8)):
        with pytest.raises(ConfigError, match="parallelism_config"):
            read_parallelism({"parallelism_config": bad}, world)
