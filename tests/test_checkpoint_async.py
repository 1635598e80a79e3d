"""Asynchronous checkpoints (`checkpoint_async: true`), at 2 processes on gloo.

- A zero3 + AdamW (fp32) run saves asynchronously at step 3 and trains on to step 6; a fresh run
  resumed from that checkpoint ends with weights and optimizer shards bit-identical (torch.equal)
  to it, and the asynchronous checkpoint's tensors equal a synchronous checkpoint of the same
  step, bit for bit.
- keep_last and `latest` are right; a save while another is written waits for it (the writes
  do not overlap, and the wait is in the second save's stall); `memory_report().staging` is the
  checkpointed state's local bytes (params + optimizer shards) while a save is pending, 0 after.
- Every worker SIGKILLed in the middle of a background write (its DCP write slowed inside the
  worker): the previous checkpoint stays `latest` and newest and verifies; a new run resumes from
  it and saves the same step again over the leftover staging folder.
- A background write that fails (a full disk on one process) is raised as the same one-line
  CheckpointError on every process at the next step boundary, and leaves nothing behind.
- SIGTERM while a save is pending (slowed): exit code 75 on every process, the pending
  checkpoint completes, the preemption checkpoint of the next step is complete and newest, and
  nothing is half-written.
"""

from __future__ import annotations

import functools
import os
import signal
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import spawn as S
import torch
import workloads as W
from planted import caught, planted

N = 24  # samples: 6 global batches of 4


def _engine(folder: Path, strategy: str = "zero3", **kw: Any) -> Any:
    import shardwise

    return shardwise.Engine(strategy=strategy, cpu=True, seed=W.SEED, checkpoint_async=True,
                            checkpoint_dir=str(folder / "checkpoints"), **kw)


def _slow_writes(seconds: float, marker: Path | None = None, first_only: bool = False) -> list[tuple]:
    """Slow each DCP data write of this process by `seconds` (touching `marker`.<rank> first);
    the returned list gets (folder, start, end) of each write."""
    import shardwise.checkpoint.sharded as ck

    real = ck._RecordingWriter.write_data
    log: list[tuple] = []

    def write_data(self: Any, plan: Any, planner: Any) -> Any:
        start = time.monotonic()
        if not (first_only and log):
            if marker is not None:
                Path(f"{marker}.{os.environ['RANK']}").touch()
            time.sleep(seconds)
        out = real(self, plan, planner)
        log.append((Path(self.path).name, start, time.monotonic()))
        return out

    ck._RecordingWriter.write_data = write_data
    return log


@dataclass(frozen=True, slots=True)
class Looped:
    """A run of `_loop`: losses, gathered weights, this process's optimizer state, engine.step."""

    losses: list[float]
    state: dict[str, torch.Tensor]
    optim: list[dict[str, torch.Tensor]]
    step: int


@dataclass(frozen=True, slots=True)
class Saving(Looped):
    """`_saving_run`: its run (Looped's fields), what it saw at steps 3 and 4 (staging bytes held
    while a save is pending and those expected, `latest` then, the back-to-back call's seconds and
    stall; staging after the wait, the checkpoints listing, `latest`), and every shard write
    (folder, start, end)."""

    staging: int
    expected: int
    latest_while_pending: str
    second_call: float
    second_stall: float
    staging_after: int
    listing: list[str]
    latest: str
    step_2_as_sync: bool
    writes: list[tuple[str, float, float]]


@dataclass(frozen=True, slots=True)
class Resumed:
    """`_resumed_runs`: the run resumed from step_3, and the failed write raised on this process
    (message, engine.step; None: nothing raised)."""

    resumed: Looped
    raised: tuple[str, int] | None


def _loop(engine: Any, steps: int, *, load: str | None = None, at_step: Any = None,
          pause: float = 0.0) -> Looped:
    """`workloads.checkpoint_loop` until optimizer step `steps`: `at_step(engine.step, model, opt)`
    after each step, `pause` seconds before each batch."""
    def each(_done: int, model: Any, opt: Any) -> None:
        if at_step is not None:
            at_step(engine.step, model, opt)

    def paused(ids: torch.Tensor) -> torch.Tensor:
        time.sleep(pause)
        return ids

    losses, model, opt, _sched = W.checkpoint_loop(engine, steps, n=N, global_batch=4, load=load,
                                                   transform=paused, at_step=each, until_step=True)
    return Looped(losses, engine.get_state_dict(model), _local_optim(opt), engine.step)


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


def _local_optim(opt: Any) -> list[dict[str, torch.Tensor]]:
    """This process's optimizer state (AdamW's shards under zero3), in parameter order."""
    return [{k: _local(v) for k, v in opt.state[p].items()} for g in opt.param_groups for p in g["params"]]


# -- resume, equality with a synchronous save, keep_last, one save in flight, staging bytes -----
def _saving_run(folder: str) -> Saving:
    root = Path(folder)
    engine = _engine(root, keep_last=2)
    writes = _slow_writes(0.4)
    seen: dict[str, Any] = {}  # Saving's fields, as the steps see them

    def at_step(step: int, model: Any, opt: Any) -> None:  # (after that step's update)
        if step == 2:
            engine.config.checkpointing.background = False
            engine.save_state(root / "sync_2")  # what step_2 must hold
            engine.config.checkpointing.background = True
            engine.save_state()  # step_2 (its slow write overlaps step 3's update), pruned at step_4
        if step == 3:
            engine.config.checkpointing.background = False
            engine.save_state(root / "sync_3")  # waits for step_2 first
            engine.config.checkpointing.background = True
            seen["step_2_as_sync"] = _identical(_all_tensors(root / "checkpoints" / "step_2"),
                                                _all_tensors(root / "sync_2"))
            engine.save_state()  # step_3
            seen["staging"] = engine.memory_report().staging  # pending: held
            optim = [v for st in _local_optim(opt) for v in st.values()]  # AdamW: step, exp_avg, exp_avg_sq
            seen["expected"] = (sum(_local(p).numel() * 4 for p in model.parameters())
                                + sum(v.numel() * v.element_size() for v in optim))
            seen["latest_while_pending"] = (root / "checkpoints" / "latest").read_text().strip()
            t0 = time.monotonic()
            engine.save_state(root / "copy_3")  # back to back: waits for step_3
            seen["second_call"] = time.monotonic() - t0
            seen["second_stall"] = engine.checkpoints.last_report.stall
        if step == 4:
            engine.save_state()  # step_4: keep_last=2 leaves step_3, step_4
            engine.wait_for_checkpoint()
            seen["staging_after"] = engine.memory_report().staging
            seen["listing"] = sorted(p.name for p in (root / "checkpoints").iterdir())
            seen["latest"] = (root / "checkpoints" / "latest").read_text().strip()

    out = _loop(engine, 6, at_step=at_step)
    engine.end_training()
    return Saving(out.losses, out.state, out.optim, out.step, writes=writes, **seen)


def _resumed_runs(folder: str, killed: str) -> Resumed:
    from shardwise.checkpoint.sharded import CheckpointError

    resumed = _loop(_engine(Path(folder)), 6, load=str(Path(folder) / "checkpoints" / "step_3"))
    # after the SIGKILL: resume from the newest (step_2) and save step_4 again over the leftovers;
    # then a background write that fails (rank 1's disk is full) is raised on every process at the
    # next step boundary
    engine = _engine(Path(killed), strategy="zero2")

    def at_step(step: int, model: Any, opt: Any) -> None:
        if step == 4:
            engine.save_state()
        if step == 5:
            engine.checkpoints.wait()  # step_4's write done first: only the next one meets the full disk
            _full_disk_on_rank_1()
            engine.save_state(Path(killed) / "failing")
            deadline = time.monotonic() + 30
            while not engine.checkpoints.failed and time.monotonic() < deadline:  # (the boundary reads it)
                time.sleep(0.01)

    raised = None
    try:  # (raised where every process reads the flag: the second boundary after step 5)
        _loop(engine, 7, load="latest", at_step=at_step)
    except CheckpointError as err:
        raised = (str(err), engine.step)
    engine.end_training()
    return Resumed(resumed, raised)


def _full_disk_on_rank_1() -> None:
    import errno

    import shardwise.checkpoint.sharded as ck

    real = ck._RecordingWriter.write_data

    def write_data(self: Any, plan: Any, planner: Any) -> Any:
        if os.environ["RANK"] == "1":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))
        return real(self, plan, planner)

    ck._RecordingWriter.write_data = write_data


def _all_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint, read in this process (DCP's own converter), flattened."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(str(folder), f"{tmp}/all.pt")
        state = torch.load(f"{tmp}/all.pt", weights_only=False)
    flat: dict[str, torch.Tensor] = {}

    def walk(prefix: str, obj: Any) -> None:
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}.{k}", v)
        elif torch.is_tensor(obj):
            flat[prefix] = obj

    walk("", state)
    return flat


def _identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# -- SIGKILL and SIGTERM during a background write: workers this test kills ----------------------
def _killed_in_write(folder: str) -> None:
    root = Path(folder)
    engine = _engine(root, strategy="zero2")
    marker = root / "writing"

    def at_step(step: int, model: Any, opt: Any) -> None:
        if step == 2:
            engine.save_state()
            engine.wait_for_checkpoint()  # step_2 is complete
            _slow_writes(60.0, marker)  # the next write hangs in the middle: the parent SIGKILLs
        if step == 4:
            engine.save_state()

    _loop(engine, 6, at_step=at_step, pause=0.05)
    engine.end_training()  # (waits for step_4's write: killed before)


def _preempted_in_write(folder: str) -> None:
    root = Path(folder)
    engine = _engine(root, checkpoint_every_steps=2)
    _slow_writes(2.0, root / "writing", first_only=True)  # step_2's write: the parent SIGTERMs meanwhile
    _loop(engine, 24, pause=0.3)
    engine.end_training()


def _run_until_marker(fn: Any, folder: Path, sig: int, timeout: float = 120) -> list[int | None]:
    """Start `fn(folder)` on 2 processes (as `spawn` does); once both have touched
    `folder/writing.<rank>`, send each `sig`; return the exit codes."""
    ctx = S._context()
    port = S.free_port()
    with tempfile.TemporaryDirectory() as out:
        procs = [ctx.Process(target=S._entry, args=(fn, r, 2, port, out, (str(folder),))) for r in range(2)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        markers = [folder / f"writing.{r}" for r in range(2)]
        while not all(m.exists() for m in markers):
            errors = sorted(Path(out).glob("*.err"))
            assert not errors and time.monotonic() < deadline, [e.read_text() for e in errors]
            assert all(p.is_alive() for p in procs), [p.exitcode for p in procs]
            time.sleep(0.02)
        for p in procs:
            os.kill(p.pid, sig)
        for p in procs:
            p.join(timeout)
        for p in procs:
            if p.is_alive():
                p.kill()
        errors = sorted(Path(out).glob("*.err"))
        assert not errors, [e.read_text() for e in errors]
        return [p.exitcode for p in procs]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    a, killed, pre = (tmp_path_factory.mktemp(n) for n in ("async", "killed", "preempted"))
    saving = S.spawn(_saving_run, 2, str(a))
    codes = _run_until_marker(_killed_in_write, killed, signal.SIGKILL)
    listing = sorted(p.name for p in (killed / "checkpoints").iterdir())
    latest = (killed / "checkpoints" / "latest").read_text().strip()
    from shardwise.checkpoint.sharded import newest, verify

    after_kill = {"codes": codes, "listing": listing, "latest": latest,
                  "newest": newest(killed / "checkpoints").name, "verified": verify(killed / "checkpoints")}
    resumed = S.spawn(_resumed_runs, 2, str(a), str(killed))
    pre_codes = _run_until_marker(_preempted_in_write, pre, signal.SIGTERM)
    return {"a": a, "saving": saving, "resumed": resumed, "killed": killed, "after_kill": after_kill,
            "pre": pre, "pre_codes": pre_codes}


def test_async_resume_is_bit_identical_and_equals_a_synchronous_save(runs: dict) -> None:
    for rank in range(2):
        straight, resumed = runs["saving"][rank], runs["resumed"][rank].resumed
        assert straight.step == resumed.step == 6
        assert straight.losses[3:] == resumed.losses  # steps 4-6, bit for bit
        assert _identical(straight.state, resumed.state)  # the whole weights, torch.equal
        assert len(straight.optim) == len(resumed.optim) == 23  # this rank's AdamW shards, each tensor
        for mine, theirs in zip(straight.optim, resumed.optim):
            assert _identical(mine, theirs)
    check_staged_copies(runs["saving"])
    root = runs["a"]
    sync, async_ = _all_tensors(root / "sync_3"), _all_tensors(root / "checkpoints" / "step_3")
    assert len(sync) > 20 and _identical(sync, async_)
    assert _identical(async_, _all_tensors(root / "copy_3"))


def test_keep_last_latest_one_save_in_flight_and_staging_bytes(runs: dict) -> None:
    r0 = runs["saving"][0]
    assert r0.listing == [".shardwise.lock", "latest", "step_3", "step_4"]
    assert r0.latest == "step_4"
    assert r0.latest_while_pending == "step_2"  # `latest` moves only once the folder is in place
    for r in runs["saving"]:
        assert r.staging == r.expected > 0  # the shards of params + AdamW state, whole bytes
        assert r.staging_after == 0
        order = [name for name, _, _ in r.writes]
        assert order == [".sync_2.incomplete", ".step_2.incomplete", ".sync_3.incomplete",
                         ".step_3.incomplete", ".copy_3.incomplete", ".step_4.incomplete"]
        ends = [end for _, _, end in r.writes]
        starts = [start for _, start, _ in r.writes]
        assert all(s >= e for s, e in zip(starts[1:], ends[:-1]))  # never two writes at once
        # the back-to-back save waited for step_3's write (slowed 0.4 s): that wait is its stall
        assert r.second_stall >= 0.3 and r.second_call >= r.second_stall - 0.01


def test_sigkill_in_a_background_write_keeps_the_previous_checkpoint(runs: dict) -> None:
    k = runs["after_kill"]
    assert k["codes"] == [-signal.SIGKILL] * 2
    assert k["latest"] == "step_2" and k["newest"] == "step_2"
    # nothing partial in sight; the killed run's lock stays (the resume below takes it over)
    assert k["listing"] == [".shardwise.lock", ".step_4.incomplete", "latest", "step_2"]
    assert len(k["verified"]) >= 5  # every file of step_2 matches its checksum
    root = runs["killed"] / "checkpoints"
    assert sorted(os.listdir(root)) == [".shardwise.lock", "latest", "step_2", "step_4"]
    assert (root / "latest").read_text().strip() == "step_4"


def test_a_failed_background_write_is_raised_on_every_process(runs: dict) -> None:
    lines = [r.raised for r in runs["resumed"]]
    # the same line on both, at the second boundary after step 5 (the agreement is read one later)
    assert lines[0] == lines[1] and lines[0][1] == 6
    assert "failing: could not write the checkpoint's tensors" in lines[0][0]
    assert "No space left on device" in lines[0][0] and "\n" not in lines[0][0]
    killed = runs["killed"]
    assert not (killed / "failing").exists() and not (killed / ".failing.incomplete").exists()


def test_sigterm_waits_for_the_pending_save(runs: dict) -> None:
    from shardwise.checkpoint.sharded import verify

    assert runs["pre_codes"] == [75, 75]
    root = runs["pre"] / "checkpoints"
    steps = sorted(int(p.name.split("_")[1]) for p in root.glob("step_*"))
    # the pending one, then the preemption's (at the second boundary after the signal)
    assert steps[0] == 2 and len(steps) == 2 and steps[1] in (3, 4, 5)
    assert (root / "latest").read_text().strip() == f"step_{steps[1]}"
    assert not [p for p in root.iterdir() if p.name.endswith(".incomplete")]
    for step in steps:
        assert len(verify(root / f"step_{step}")) >= 5


def test_planner_predicts_the_staging_copy(runs: dict) -> None:
    """The planner's `checkpoint_async` term equals the staging bytes a real zero3 run held while
    its save was pending (the same model and AdamW, 2 processes), exactly: on a CPU target it is
    part of the peak (`breakdown["staging"]`), on a CUDA target host memory; ddp and zero1 stage
    the whole state (zero1 gathers its optimizer state for the checkpoint), zero2 the shards."""
    from shardwise.plan import PlanRequest, plan_module
    from shardwise.plan.trace import Candidate

    measured = runs["saving"][0].staging
    model = W.build("tiny")
    ids = next(iter(torch.utils.data.DataLoader(W.Tokens(8), batch_size=2)))
    cands = [Candidate(s, "none") for s in ("ddp", "zero1", "zero2", "zero3")]
    adamw = functools.partial(torch.optim.AdamW, lr=1e-3)  # (the state of the run's AdamW: groups aside)
    staged = {}
    for device in ("cpu", "cuda"):
        base = plan_module(model, ids, PlanRequest(world_size=2, device_memory="1TB", device=device,
                                                   candidates=cands, optimizer=adamw))
        plan = plan_module(model, ids, PlanRequest(world_size=2, device_memory="1TB", device=device,
                                                   candidates=cands, optimizer=adamw,
                                                   checkpoint_async=True))
        for before, after in zip(base.plans, plan.plans):
            grown = (after.peak - before.peak) if device == "cpu" else (after.host - before.host)
            assert grown == pytest.approx(after.breakdown.get("staging", after.host - before.host), rel=1e-6)
            staged[device, after.candidate.strategy] = grown
    for device in ("cpu", "cuda"):
        assert staged[device, "zero3"] == measured  # bytes, exactly
        assert staged[device, "zero2"] == measured
        whole = staged[device, "ddp"]
        assert staged[device, "zero1"] == whole and measured < whole <= 2 * measured


def check_staged_copies(saving: list[Saving]) -> None:
    """step_2, whose background write ran while step 3 updated the weights and AdamW's state in
    place, holds what a synchronous save at step 2 holds, tensor for tensor."""
    assert all(rank.step_2_as_sync for rank in saving), \
        f"step_2 (written in the background) as a synchronous save, per process: " \
        f"{[r.step_2_as_sync for r in saving]}"


def test_a_stage_that_aliases_the_live_tensors_is_caught(tmp_path: Path) -> None:
    caught(check_staged_copies, S.spawn(planted(_saving_run, "async_stage_aliases"), 2, str(tmp_path)),
           must=r"^step_2 \(written in the background\) as a synchronous save, per process: \[False, False\]")
