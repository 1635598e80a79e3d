"""One run per checkpoint folder, Accelerator's automatic checkpoint names, and a full disk.

- Two runs of 2 processes on the same checkpoint_dir at the same time: the second is refused
  (the same line on both of its processes, naming the first run's host, pid and start time) and
  the first run's checkpoints are whole and its own. A run that died leaves its lock; the next
  run takes it over with one line. A run that exits normally leaves no lock behind.
- `ProjectConfiguration(automatic_checkpoint_naming=True, total_limit=2)` in a project_dir that
  holds an earlier run's checkpoint_0..2: the new run continues at checkpoint_3, never touches
  the earlier run's folders (a user's note in checkpoint_0 included), keeps one of its own that a
  user wrote into (one warning), and `load_state()` resumes the new run.
- A save that the disk cannot hold names "No space left on device" (or the file-size limit) with
  the path and the bytes needed, also where torch's zip writer used to say `unexpected pos`.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import workloads as W
from planted import caught, planted, planted_here
from spawn import run_command, spawn

LOCK = ".shardwise.lock"


def _wait_for(path: Path, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.05)


def _step(engine: Any, model: Any, opt: Any, seed: int) -> None:
    g = torch.Generator().manual_seed(seed + engine.process_index)
    ids = torch.randint(0, W.VOCAB, (2, W.SEQ), generator=g)
    engine.backward(W.lm_loss(model, ids))
    opt.step()
    opt.zero_grad()


def _run(folder: str, seed: int) -> tuple[Any, Any, Any]:
    import shardwise

    engine = shardwise.Engine(
        strategy="zero3", cpu=True, seed=seed, checkpoint_dir=f"{folder}/ckpt", progress=False
    )
    model = W.build("tiny")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(seed)  # each run its own weights
    opt = W.make_optimizer(model)
    model, opt = engine.prepare(model, opt)
    return engine, model, opt


def _first_run(folder: str) -> dict[str, Any]:
    """Run A: owns ckpt/ (its load_state() found nothing), saves step_1, lets run B try, saves step_2."""
    engine, model, opt = _run(folder, 1)
    engine.load_state()
    _step(engine, model, opt, 1)
    engine.save_state()
    out = {"pid": os.getpid(), "w1": engine.get_state_dict(model)}
    if engine.is_main_process:
        (Path(folder) / "a_ready").touch()
    _wait_for(Path(folder) / "b_done")
    _step(engine, model, opt, 2)
    engine.save_state()
    out["w2"] = engine.get_state_dict(model)
    out["lock"] = json.loads((Path(folder) / "ckpt" / LOCK).read_text())
    return out


def _second_run(folder: str) -> dict[str, Any]:
    """Run B, started while A runs, on the same checkpoint_dir: refused, before it loads or saves."""
    from shardwise.checkpoint.sharded import CheckpointError

    _wait_for(Path(folder) / "a_ready")
    engine, model, opt = _run(folder, 5)
    out: dict[str, Any] = {}
    try:
        engine.load_state()
    except CheckpointError as err:
        out["load"] = str(err)
    _step(engine, model, opt, 5)
    try:
        engine.save_state()  # would be step_1, A's
    except CheckpointError as err:
        out["save"] = str(err)
    engine.save_state(f"{folder}/b_elsewhere")  # a folder outside checkpoint_dir needs no lock
    engine.wait_for_everyone()
    if engine.is_main_process:
        (Path(folder) / "b_done").touch()
    return out


class _Big:
    """A registered object whose state (1.6 MB, in the loop state) outgrows the size limit below."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"t": torch.zeros(400_000)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        pass


def _after_a_died(folder: str) -> dict[str, Any]:
    """Run C: A's workers ended without their atexit (os._exit), so its lock names a dead pid.
    C takes it over with one line, resumes A's step_2, and a full disk in its save says so."""
    from shardwise.checkpoint.sharded import CheckpointError

    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logging.getLogger("shardwise").addHandler(Keep(logging.WARNING))
    engine, model, opt = _run(folder, 9)
    step = engine.load_state()
    out: dict[str, Any] = {"step": step, "lines": lines, "pid": os.getpid(),
                           "lock": json.loads((Path(folder) / "ckpt" / LOCK).read_text())}
    # the loop state (engine.pt, written by process 0 with torch.save) outgrows a file-size
    # limit that the tensor shards fit in: a real EFBIG from the kernel, inside torch.save
    engine.register_for_checkpointing(_Big())
    _step(engine, model, opt, 9)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    if engine.process_index == 0:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (600_000, hard))
    try:
        engine.save_state(f"{folder}/full")
    except CheckpointError as err:
        out["disk full"] = str(err)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    return out


_NORMAL_EXIT = """
import os, sys, shardwise, torch
engine = shardwise.Engine(strategy="ddp", cpu=True, checkpoint_dir=sys.argv[1], progress=False)
model = engine.prepare(torch.nn.Linear(2, 2))
engine.load_state()
engine.save_state()
print(sorted(os.listdir(sys.argv[1])))
"""


def _full_state(path: Path) -> dict[str, torch.Tensor]:
    from shardwise.checkpoint.sharded import full_model_state

    state: dict[str, torch.Tensor] = full_model_state(path)[0]
    return state


def test_two_runs_in_one_checkpoint_folder(tmp_path: Path) -> None:
    got: dict[str, Any] = {}
    a = threading.Thread(target=lambda: got.setdefault("a", spawn(_first_run, 2, str(tmp_path), timeout=300)))
    a.start()
    b = spawn(_second_run, 2, str(tmp_path), timeout=300)
    a.join()
    first = got["a"][0]
    holder = f"host {socket.gethostname()}, pid {first['pid']}, started {first['lock']['started']}"
    for case in ("load", "save"):
        lines = [r.get(case) for r in b]
        assert lines[0] is not None and lines[0] == lines[1], (case, lines)  # every process, one line
        assert "\n" not in lines[0]
        assert lines[0].startswith(f"{tmp_path}/ckpt: in use by another run ({holder})")
        assert "give this run another checkpoint_dir" in lines[0]
    root = tmp_path / "ckpt"
    assert sorted(os.listdir(root)) == [LOCK, "latest", "step_1", "step_2"]  # A's, and no B's
    for step, key in ((1, "w1"), (2, "w2")):  # A's weights: B wrote nothing here
        state = _full_state(root / f"step_{step}")
        assert all(torch.equal(state[k], first[key][k]) for k in first[key]), step
    assert (tmp_path / "b_elsewhere" / "meta.json").is_file()

    # A's workers left without atexit: its lock names a dead pid; the next run takes it over
    c = spawn(_after_a_died, 2, str(tmp_path), timeout=300)
    assert c[0]["step"] == 2 and c[0]["lock"]["pid"] == c[0]["pid"]
    took = [line for line in c[0]["lines"] if "took over" in line]
    assert took == [f"{root / LOCK}: took over the run lock from a run that is no longer alive ({holder}): "
                    "its process is gone from this host"]  # the rule that allowed it
    assert not [line for line in c[1]["lines"] if "took over" in line]  # said once, by process 0
    full = [r["disk full"] for r in c]
    assert full[0] == full[1] and "\n" not in full[0], full
    assert full[0].startswith(f"{tmp_path}/full: could not finish the checkpoint: File too large (")
    assert "engine.pt); it needs " in full[0] and "raise it, or save elsewhere" in full[0], full[0]
    assert "unexpected pos" not in full[0] and not (tmp_path / "full").exists()

    # a run that ends normally (atexit) takes over a dead run's lock (C's) and leaves none behind
    later = tmp_path / "later"
    later.mkdir()
    (later / LOCK).write_text((root / LOCK).read_text())
    proc = run_command([sys.executable, "-c", _NORMAL_EXIT, str(later)], timeout=300,
                       env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert LOCK in proc.stdout  # held while it ran ...
    assert f"pid {c[0]['pid']}," in proc.stderr and "took over the run lock" in proc.stderr
    assert sorted(os.listdir(later)) == ["latest", "step_0"]  # ... gone after exit


def _lock_info(**fields: Any) -> dict[str, Any]:
    from shardwise.checkpoint import runlock

    return {**runlock._me(), **fields}


def test_run_lock_takes_over_only_a_provably_dead_holder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Single process (no process group): who may take a lock over, and the lines."""
    check_takeover_rules(tmp_path, monkeypatch)


def test_planted_start_time_unread_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`start_time_unread`: a holder's start time unreadable, so every same-host holder looks like
    a reused pid; the live run's lock is taken over, which the rules' check refuses."""
    from shardwise.checkpoint import runlock

    try:
        with planted_here("start_time_unread"):
            caught(check_takeover_rules, tmp_path, monkeypatch,
                   must=r"^a live run's lock on this host: \S+: took over the run lock from a run that is "
                        r"no longer alive \(host \S+, pid \d+, started then\): its process is gone from "
                        r"this host")
    finally:
        runlock.release_all()  # the locks the planted run took (and their heartbeats)


def check_takeover_rules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from shardwise.checkpoint import runlock
    from shardwise.checkpoint.sharded import CheckpointError

    def attempt(info: dict[str, Any] | None) -> str:
        root = tmp_path / f"r{len(list(tmp_path.iterdir()))}"
        root.mkdir()
        if info is not None:
            (root / LOCK).write_text(json.dumps(info))
        try:
            line = runlock.hold(root, 0) or "held"
        except CheckpointError as err:
            return str(err)
        assert json.loads((root / LOCK).read_text())["pid"] == os.getpid()
        return line

    parent = _lock_info(pid=os.getppid(), start_ticks=runlock._start_ticks(os.getppid()), started="then")
    live = attempt(parent)
    assert "in use by another run (host" in live, f"a live run's lock on this host: {live}"  # same start time
    # the pid now names another process
    reused = attempt({**parent, "start_ticks": parent["start_ticks"] + 1})
    assert "took over the run lock" in reused
    dead = subprocess.Popen(["true"])  # a pid that is gone
    dead.wait()
    assert "took over the run lock" in attempt(_lock_info(pid=dead.pid, started="then"))
    assert "took over the run lock" in attempt(_lock_info(pid=os.getppid(), boot_id="another boot"))
    elsewhere = attempt(_lock_info(host="node-7", pid=os.getppid()))
    assert "held by a run on another machine (host node-7" in elsewhere and "lock_lease_s=300 s" in elsewhere
    assert "unreadable run lock" in attempt({})
    # a torchrun --max-restarts relaunch whose process 0 is now on another machine: the earlier
    # attempt of the same job is over; the same attempt (or another job) is not
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-42")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert "took over the run lock" in attempt(_lock_info(host="node-7", job="job-42", attempt=0))
    assert "another machine" in attempt(_lock_info(host="node-7", job="job-42", attempt=1))
    assert attempt(None) == "held"
    runlock.release_all()
    assert not list(tmp_path.glob(f"*/{LOCK}.*"))  # no temporary or set-aside files left
    assert [p.name for p in tmp_path.glob(f"*/{LOCK}")] == [LOCK] * 4  # only the four refusals' locks remain


def test_disk_full_says_no_space_left_with_the_bytes_needed(tmp_path: Path) -> None:
    """ENOSPC from the kernel (/dev/full), and torch's zip writer's failure (which carries no
    errno), both said as the OS would, with the path and the bytes needed."""
    check_disk_full_lines(tmp_path)


def test_planted_zip_failure_in_torchs_words_is_caught(tmp_path: Path) -> None:
    """`zip_failure_in_torchs_words`: torch's errno-less zip-writer failure passed on as it is
    ("unexpected pos"); the check wants the disk named full, with the bytes needed."""
    with planted_here("zip_failure_in_torchs_words"):
        caught(check_disk_full_lines, tmp_path,
               must=r"could not write the checkpoint: \[enforce fail at inline_container\.cc:\d+\] \. "
                    r"unexpected pos \d+ vs \d+")


def check_disk_full_lines(tmp_path: Path) -> None:
    import shutil

    from shardwise.checkpoint.storage import os_error_line, write_torch

    state = {"t": torch.zeros(5000)}
    with pytest.raises(OSError) as err:
        write_torch(state, Path("/dev/full"))
    assert err.value.errno == errno.ENOSPC
    line = os_error_line(tmp_path / "ckpt", "write the checkpoint", err.value)
    assert line.startswith(
        f"{tmp_path}/ckpt: could not write the checkpoint: No space left on device (/dev/full); "
        "it needs 0.0 MB ("
    ), line
    assert f"free space on the disk of {tmp_path}/ckpt" in line, line
    with pytest.raises(RuntimeError) as zip_err:
        torch.save(state, "/dev/full")  # what torch.save(obj, path) says: "unexpected pos"
    needed = shutil.disk_usage(tmp_path).free + 1
    line = os_error_line(tmp_path / "ckpt", "write the checkpoint", zip_err.value, needed)
    assert "No space left on device; it needs" in line and "unexpected pos" not in line, line
    assert f"free space on the disk of {tmp_path}/ckpt" in line


def _two_runs_in_one_project(folder: str) -> dict[str, Any]:
    """An earlier run's checkpoint_0..2 (a user's note in checkpoint_0), then a new run with
    total_limit=2 that saves four times (a user's note in its second checkpoint), then a resume."""
    from shardwise import Accelerator, ProjectConfiguration

    os.chdir(folder)

    def accelerator(limit: int | None) -> Any:
        pc = ProjectConfiguration(project_dir=folder, automatic_checkpoint_naming=True, total_limit=limit)
        return Accelerator(cpu=True, project_config=pc, mixed_precision="no")

    def train(acc: Any, seed: int) -> tuple[Any, Any]:
        model = W.build("tiny")
        opt = W.make_optimizer(model)
        model, opt = acc.prepare(model, opt)
        return model, opt

    root = Path(folder) / "checkpoints"
    old = accelerator(None)
    model, opt = train(old, 1)
    for _ in range(3):
        _step(old, model, opt, 1)
        old.save_state()
    main = old.is_main_process
    if main:
        (root / "checkpoint_0" / "notes.txt").write_text("the good run")
    old.wait_for_everyone()
    before = {p.name: _digests(p) for p in sorted(root.iterdir())}

    new = accelerator(2)
    model, opt = train(new, 2)
    caught: list[str] = []
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for i in range(4):
            _step(new, model, opt, 20 + i)
            new.save_state()
            if i == 1 and main:
                (root / "checkpoint_4" / "my_eval.json").write_text("{}")
            new.wait_for_everyone()
        caught = [str(w.message) for w in seen]
    listing = sorted(p.name for p in root.iterdir())
    untouched = {name: _digests(root / name) for name in before} == before
    weights, step = new.get_state_dict(model), new.step

    resumed = accelerator(2)
    model, opt = train(resumed, 3)
    got_step = resumed.load_state()
    return {
        "listing": listing,
        "untouched": untouched,
        "warnings": caught,
        "step": step,
        "resumed_step": got_step,
        "same_weights": W.max_diff(resumed.get_state_dict(model), weights) == 0.0 if main else True,
        "next": resumed.project_configuration.iteration,
    }


def _digests(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_automatic_checkpoint_naming_keeps_an_earlier_runs_checkpoints(tmp_path: Path) -> None:
    check_project_naming(spawn(_two_runs_in_one_project, 2, str(tmp_path), timeout=300)[0], tmp_path)


def test_planted_total_limit_over_every_checkpoint_is_caught(tmp_path: Path) -> None:
    """`total_limit_over_every_checkpoint`: total_limit counts the earlier run's checkpoints too
    (Accelerate's rule) and removes them; the check wants them untouched."""
    run = planted(_two_runs_in_one_project, "total_limit_over_every_checkpoint")
    caught(check_project_naming, spawn(run, 2, str(tmp_path), timeout=300)[0], tmp_path,
           must=r"^the project's checkpoints after the new run: \['\.shardwise\.lock', 'checkpoint_0', "
                r"'checkpoint_4'")  # the earlier run's 1 and 2 removed


def check_project_naming(out: dict[str, Any], tmp_path: Path) -> None:
    # the new run wrote checkpoint_3..6; total_limit removed its own checkpoint_3, kept its
    # checkpoint_4 (a user's file in it), never touched the earlier run's 0..2
    assert out["listing"] == [LOCK, "checkpoint_0", "checkpoint_1", "checkpoint_2", "checkpoint_4",
                              "checkpoint_5", "checkpoint_6"], \
        f"the project's checkpoints after the new run: {out['listing']}"
    assert out["untouched"]
    kept = [w for w in out["warnings"] if "kept (total_limit)" in w]
    assert len(kept) == 1, kept
    assert "checkpoint_4: kept (total_limit)" in kept[0] and "my_eval.json" in kept[0], kept
    assert sum("this run's checkpoints start at checkpoint_3" in w for w in out["warnings"]) == 1
    assert out["step"] == 4 and out["resumed_step"] == 4 and out["same_weights"]  # the new run resumes
    assert out["next"] == 7
    assert (tmp_path / "checkpoints" / "checkpoint_0" / "notes.txt").read_text() == "the good run"


def test_run_lock_rules_for_a_requeue_and_an_expired_lease(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A requeue of the same SLURM job takes the lock over at once, wherever it lands; an
    unrelated run only once the holder's heartbeat is older than the lease; a lock of the same
    job and attempt whose pid is gone on this host (a same-host requeue whose restart count did
    not move) is a dead one, not a live one. Each takeover says its rule in one line."""
    check_requeue_rules(tmp_path, monkeypatch)


def test_a_lock_whose_heartbeat_is_never_read_is_caught(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    with planted_here("heartbeat_never_read"):
        caught(check_requeue_rules, tmp_path, monkeypatch,
               must=r"took over the run lock from a run that is no longer alive \(host node-7, pid \d+, "
                    r"started then\): its heartbeat stopped inf s ago \(lock_lease_s 300\)")


def check_requeue_rules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from shardwise.checkpoint import runlock
    from shardwise.checkpoint.sharded import CheckpointError

    def attempt(info: dict[str, Any], *, age: float = 0.0, lease: float = 300.0) -> str:
        root = tmp_path / f"r{len(list(tmp_path.iterdir()))}"
        root.mkdir()
        (root / LOCK).write_text(json.dumps(info))
        if age:
            then = time.time() - age
            os.utime(root / LOCK, (then, then))
        try:
            line = runlock.hold(root, 0, lease) or "held"
        except CheckpointError as err:
            return str(err)
        assert json.loads((root / LOCK).read_text())["pid"] == os.getpid()
        return line

    alive = {"host": "node-7", "pid": os.getppid(), "started": "then"}
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    requeued = attempt(_lock_info(**alive, slurm_job="77", slurm_restart=0))
    assert requeued.endswith("a later attempt of SLURM job 77 (restart 1; the lock's: 0)"), requeued
    assert "\n" not in requeued
    same = attempt(_lock_info(**alive, slurm_job="77", slurm_restart=1))
    assert "held by a run on another machine (host node-7" in same and "heartbeat 0 s old" in same, same
    other_job = attempt(_lock_info(**alive, slurm_job="76", slurm_restart=0))
    assert "held by a run on another machine" in other_job, other_job
    # an unrelated run: refused while the lease holds, taken over once it has expired
    assert "held by a run on another machine" in attempt(_lock_info(**alive, slurm_job="9"), age=200)
    expired = attempt(_lock_info(**alive, slurm_job="9"), age=400)
    assert expired.endswith("its heartbeat stopped 400 s ago (lock_lease_s 300)"), expired
    monkeypatch.delenv("SLURM_JOB_ID")
    monkeypatch.delenv("SLURM_RESTART_COUNT")
    # the same torchrun run and attempt on this host, its pid gone: dead (was: judged alive)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "slurm-77")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    dead = subprocess.Popen(["true"])
    dead.wait()
    gone = attempt(_lock_info(pid=dead.pid, job="slurm-77", attempt=0, started="then"))
    assert gone.endswith("its process is gone from this host"), gone


_HOLDER = """
import sys, time
from pathlib import Path
from shardwise.checkpoint import runlock
runlock.hold(Path(sys.argv[1]), 0, float(sys.argv[2]))
print("held", flush=True)
time.sleep(600)
"""


def test_a_live_holder_is_never_taken_over_and_a_dead_ones_lease_expires(tmp_path: Path) -> None:
    """A run on another host (a UTS namespace of its own) holds the lock with a 2 s lease and
    keeps its heartbeat: 5 s later (past the lease since it took the lock) this host's run is
    still refused. SIGKILLed, its lock stays; an unrelated run is refused until the heartbeat is
    2 s old, then takes it over, saying so."""
    from shardwise.checkpoint import runlock
    from shardwise.checkpoint.sharded import CheckpointError

    assert shutil.which("unshare"), "unshare (util-linux) is needed to run a holder on another host name"
    root = tmp_path / "ckpt"
    holder = subprocess.Popen(["unshare", "--uts", "sh", "-c", 'hostname other-node && exec "$@"', "sh",
                               sys.executable, "-c", _HOLDER, str(root), "2"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held", holder.stderr
        assert json.loads((root / LOCK).read_text())["host"] == "other-node"
        time.sleep(5)
        with pytest.raises(CheckpointError) as live:
            runlock._held.pop(str(root), None)
            runlock.hold(root, 0, 2.0)
        said = str(live.value)
        assert "held by a run on another machine (host other-node" in said and "\n" not in said, said
        age = runlock.heartbeat_age(root / LOCK)
        assert age is not None and age < 1.0, age  # refreshed every 0.2 s
    finally:
        holder.kill()
        holder.wait()
    with pytest.raises(CheckpointError):  # dead now, but its heartbeat is younger than the lease
        runlock.hold(root, 0, 2.0)
    time.sleep(2.5)
    line = runlock.hold(root, 0, 2.0)
    assert line is not None and "took over the run lock" in line and "its heartbeat stopped" in line, line
    assert json.loads((root / LOCK).read_text())["pid"] == os.getpid()
    runlock.release_all()
    assert not (root / LOCK).exists()
