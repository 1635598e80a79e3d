"""Training that survives failures, proven end to end under `shardwise launch` (torchrun).

tests/scripts/resilient.py is an ordinary loop plus two lines (`engine.load_state()` at its start,
`checkpoint_every_steps` in its config). Faults are injected through SHARDWISE_TEST_FAULT:
- a worker SIGKILLs itself after step 5 (first attempt only), launched with --max-restarts 1:
  the run ends bit-identical (fp32) to an uninterrupted one, under zero3, ddp and DeepSpeed;
- SIGTERM to `shardwise launch` and both workers at once at step 3, SIGTERM twice to the launcher,
  Ctrl-C twice: the workers checkpoint at the next boundary and exit 75, the launcher names the
  saved step; a relaunch resumes from it and finishes bit-identical to the uninterrupted run;
- `load_state()` that finds nothing says so, or refuses (`resume: required`, a restart after an
  earlier attempt saved); `checkpoint_every_steps` saves the final step at `end_training()`;
- a rank hangs inside step 2: with collective_timeout_s 15 every process has exited within 60 s,
  the error names the step and the rank that did not arrive, and the newest checkpoint is the
  last complete one;
- elastic world size: saved at 4 processes with train_batch_size 8, resumed at 2 with the
  accumulation doubled, within the equivalence tolerances of the uninterrupted 4-process run.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import workloads as W
import yaml
from planted import caught, fault_env, planted_here
from spawn import GLOO_ABORT, spawn

SCRIPT = Path(__file__).parent / "scripts" / "resilient.py"
sys.path.insert(0, str(SCRIPT.parent))
from resilient import read_losses  # noqa: E402

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


def _config(folder: Path, **settings: Any) -> Path:
    cfg = {"cpu": True, "seed": W.SEED, "checkpoint_dir": str(folder / "checkpoints"),
           "launch": {"num_processes": 2}, **settings}
    path = folder / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _command(config: Path, folder: Path, *flags: str) -> list[str]:
    return [sys.executable, "-m", "shardwise", "launch", "--config", str(config), *flags, str(SCRIPT),
            str(folder)]


def _env(fault: str = "") -> dict[str, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore", "SHARDWISE_TEST_FAULT": fault}
    env.pop("SHARDWISE_CONFIG", None)
    return env


def _run(config: Path, folder: Path, *flags: str, fault: str = "", timeout: float = 300,
         planted_fault: str | None = None) -> subprocess.CompletedProcess[str]:
    """A launch; once more if gloo aborted while connecting (an infrastructure flake, see spawn).
    (`fault`: the script's own, tests/scripts/resilient.py; `planted_fault`: tests/planted.py's.)"""
    folder.mkdir(parents=True, exist_ok=True)
    env = fault_env(planted_fault, _env(fault)) if planted_fault else _env(fault)
    for _ in range(2):
        proc = subprocess.run(_command(config, folder, *flags), check=False, capture_output=True, text=True,
                              env=env, timeout=timeout, cwd=folder)
        if not (proc.returncode != 0 and GLOO_ABORT in proc.stderr and "starting at step" not in proc.stdout):
            return proc
    return proc


def _result(folder: Path) -> tuple[dict[int, float], dict[str, torch.Tensor]]:
    return read_losses(folder), torch.load(folder / "final.pt", weights_only=True)


def _identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _start_slow(config: Path, folder: Path, *, steps: int,
                planted_fault: str | None = None) -> subprocess.Popen[str]:
    """The script launched slowed down (0.4 s a step), once it has logged `steps` losses."""
    env = fault_env(planted_fault, _env("slow:0.4")) if planted_fault else _env("slow:0.4")
    proc = subprocess.Popen(_command(config, folder), env=env, cwd=folder,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    losses = folder / "losses.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (losses.is_file()
                                               and len(losses.read_text().splitlines()) >= steps):
        time.sleep(0.05)
    return proc


# -- a worker dies: torchrun restarts the group, the run resumes from the newest checkpoint -------
KILL_CASES = [{"strategy": "zero3"}, {"strategy": "ddp"}]
if HAS_DEEPSPEED:
    KILL_CASES.append({"strategy": "zero3", "backend": "deepspeed"})


@pytest.mark.parametrize("settings", KILL_CASES, ids=lambda s: "+".join(s.values()))
def test_sigkilled_worker_costs_at_most_the_checkpoint_interval(
    settings: dict[str, str], tmp_path: Path
) -> None:
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    straight.mkdir()
    killed.mkdir()
    ref = _run(_config(straight, checkpoint_every_steps=2, **settings), straight)
    assert ref.returncode == 0, ref.stderr[-3000:]
    run = _run(_config(killed, checkpoint_every_steps=2, **settings), killed, "--max-restarts", "1",
               fault="kill:5:1")
    assert run.returncode == 0, run.stderr[-3000:]
    log = run.stdout + run.stderr
    assert "attempt 0: starting at step 0" in log and "attempt 1: starting at step 4" in log
    assert "the worker group was restarted (1 restart(s) so far)" in log
    assert f"resumed from {killed / 'checkpoints' / 'step_4'} at step 4" in log
    ref_losses, ref_state = _result(straight)
    losses, state = _result(killed)
    assert list(losses) == list(range(1, 9)) and losses == ref_losses  # every step, bit for bit
    assert _identical(state, ref_state)


# -- preemption as schedulers send it: a checkpoint at the next boundary, a true message, a relaunch -
def _stop(folder: Path, config: Path, how: str) -> tuple[int, subprocess.CompletedProcess[str] | None]:
    """Launch slowed down, signal it after 3 steps as `how` says, check what the stop left; return
    the step it saved and the finished relaunch."""
    saved = check_stop(folder, how, *_signalled(folder, config, how))
    return saved, (_run(config, folder) if how != "sigint twice" else None)  # (the same resume as SIGTERM's)


def _signalled(folder: Path, config: Path, how: str, planted_fault: str | None = None, *,
               processes: int = 2, timeout: float = 90) -> tuple[int, str]:
    """Launched slowed down and signalled after 3 steps as `how` says: the exit status, stderr."""
    proc = _start_slow(config, folder, steps=3, planted_fault=planted_fault)
    found = subprocess.run(["pgrep", "-f", f"{SCRIPT} {folder}"], check=False, capture_output=True, text=True)
    workers = [int(pid) for pid in found.stdout.split() if int(pid) != proc.pid]
    assert len(workers) == processes, found.stdout
    sig = signal.SIGINT if how == "sigint twice" else signal.SIGTERM
    if how == "everyone":  # SLURM's scancel / preemption, Kubernetes: every process at once
        for pid in [proc.pid, *workers]:
            os.kill(pid, signal.SIGTERM)
    else:  # a second signal (Ctrl-C again, scancel again) while the workers save
        proc.send_signal(sig)
        time.sleep(0.3)
        proc.send_signal(sig)
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, err


def check_stop(folder: Path, how: str, code: int, err: str) -> int:
    """What a stop by signals left: the exit status, the checkpoint, the lines; the step saved."""
    sig = signal.SIGINT if how == "sigint twice" else signal.SIGTERM
    assert code == 128 + sig, f"exit status {code}: {err[-3000:]}"
    steps = sorted(int(p.name.split("_")[1]) for p in (folder / "checkpoints").glob("step_*"))
    # the signal came after step 3; every process stops at the second boundary after it
    assert steps and steps[-1] in (3, 4, 5), f"checkpoints at steps {steps}: {err[-3000:]}"
    saved = steps[-1]
    assert f"stopped after step {saved} (SIGTERM) with its checkpoint saved in " in err, \
        f"no worker's stop line: {err[-3000:]}"
    assert "; exit code 75" in err and "forcefully exiting" not in err, f"a worker SIGKILLed: {err[-3000:]}"
    name = sig.name + (" (and 1 more signal(s), ignored while the workers saved)" if how != "everyone"
                       else "")
    assert (f"shardwise launch: stopped by {name}; "
            f"the workers saved {folder / 'checkpoints' / f'step_{saved}'} "
            f"(step {saved}) in ") in err, err[-3000:]
    assert f"and exited 75; the same command resumes from step {saved}" in err
    return saved


def test_planted_repeat_signal_exits_is_caught(tmp_path: Path) -> None:
    """`repeat_signal_exits`: a worker's second stop signal (SIGTERM to every process: the
    scheduler's and the launcher's forwarded one) ends it at once; the stop check fails."""
    folder = tmp_path / "everyone"
    folder.mkdir()
    code, err = _signalled(folder, _config(folder, strategy="zero3"), "everyone", "repeat_signal_exits")
    caught(check_stop, folder, "everyone", code, err, must=r"^checkpoints at steps \[\]: ")


def test_preemption_signals_to_every_process_and_repeated_lose_no_step(tmp_path: Path) -> None:
    straight = tmp_path / "straight"
    straight.mkdir()
    ref = _run(_config(straight, strategy="zero3"), straight)
    assert ref.returncode == 0, ref.stderr[-3000:]
    ref_losses, ref_state = _result(straight)
    for how in ("everyone", "sigterm twice", "sigint twice"):
        folder = tmp_path / how.replace(" ", "_")
        folder.mkdir()
        saved, again = _stop(folder, _config(folder, strategy="zero3"), how)
        if again is None:
            continue
        assert again.returncode == 0, again.stderr[-3000:]
        assert f"starting at step {saved}" in again.stdout and f"at step {saved}" in again.stderr
        got_losses, state = _result(folder)
        assert got_losses == ref_losses and _identical(state, ref_state), how  # bit-identical (fp32)


# -- a rank hangs: the collective times out, every process ends, the checkpoint is whole -----------
def test_a_hung_rank_ends_the_run_with_an_error_naming_it(tmp_path: Path) -> None:
    from shardwise.checkpoint.sharded import newest, verify

    config = _config(tmp_path, strategy="zero3", checkpoint_every_steps=1, collective_timeout_s=15,
                     preempt_grace_s=5)
    t0 = time.monotonic()
    run = _run(config, tmp_path, fault="hang:2:1", timeout=120)
    took = time.monotonic() - t0
    assert run.returncode != 0
    assert took < 60, took
    err = run.stderr
    assert ("shardwise: error: rank 0: step 2: a collective did not complete within "
            "collective_timeout_s=15 s") in err, err[-3000:]
    assert "rank 1 (last seen in step 2" in err and "did not arrive" in err
    assert "shardwise launch: rank 0 (local rank 0" in err  # the launcher names who failed
    assert newest(tmp_path / "checkpoints") == tmp_path / "checkpoints" / "step_1"
    assert len(verify(tmp_path / "checkpoints" / "step_1")) >= 5
    leftover = subprocess.run(["pgrep", "-f", f"{SCRIPT} {tmp_path}"], check=False, capture_output=True,
                              text=True)
    assert leftover.stdout.strip() == "", leftover.stdout  # no process left behind


# -- every rank stuck in a collective: a stop signal still ends the run within the grace ----------
GRACE, STUCK_TIMEOUT = 5, 45


def _stuck(folder: Path, planted_fault: str | None = None) -> tuple[int | None, str, float]:
    """tests/scripts/resilient.py with every rank waiting at step 3 in a collective that never
    completes, then SIGTERM to the launcher alone: (its exit code, stderr, seconds to exit)."""
    config = _config(folder, strategy="zero3", preempt_grace_s=GRACE, collective_timeout_s=STUCK_TIMEOUT)
    env = fault_env(planted_fault, _env("stuck:3")) if planted_fault else _env("stuck:3")
    return _blocked(config, folder, env, "stuck", STUCK_TIMEOUT + 60, "SIGTERM", signal.SIGTERM)


def _blocked(config: Path, folder: Path, env: dict[str, str], marker: str, limit: float, after: str,
             signum: int | None = None) -> tuple[int | None, str, float]:
    """Launch the script, wait until every rank wrote `<marker>.<rank>` (it is blocked), send
    `signum` to the launcher if any, and wait up to `limit` s for the run to end (killed after
    it, saying so): (exit code, stderr, seconds from the block or the signal to the exit)."""
    proc = subprocess.Popen(_command(config, folder), env=env, cwd=folder, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not all((folder / f"{marker}.{r}").is_file() for r in range(2)):
        time.sleep(0.1)
    if signum is not None:
        time.sleep(1.0)  # (inside the collective)
    start = time.monotonic()
    if signum is not None:
        proc.send_signal(signum)
    try:
        _, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        from spawn import kill_tree

        kill_tree(proc.pid)
        _, err = proc.communicate()
        err = f"(still running {limit} s after {after})\n{err}"
    return proc.returncode, err, time.monotonic() - start


def check_stuck_stopped(code: int | None, err: str, took: float) -> None:
    """Ended by SIGTERM within preempt_grace_s (+ 15 s for the launcher and teardown), not by the
    collective's timeout: exit 128 + SIGTERM, each rank's line saying it had no step boundary."""
    assert took <= GRACE + 15 and code == 128 + signal.SIGTERM, \
        f"the stuck run ended after {took:.0f} s with exit code {code}: {err.strip().splitlines()[-1:]}"
    said = f"no step boundary within preempt_grace_s={GRACE} s of SIGTERM; exiting (143) without a checkpoint"
    assert said in err, err[-3000:]
    assert "stopped by SIGTERM; nothing could be saved" in err, err[-3000:]


def test_sigterm_ends_a_run_stuck_in_a_collective_within_the_grace(tmp_path: Path) -> None:
    """Python runs a signal's handler only when the main thread returns to the interpreter, which a
    rank waiting inside gloo never does: the watch thread sees the signal arrive (its wakeup fd)
    and ends the process preempt_grace_s later, not after collective_timeout_s."""
    check_stuck_stopped(*_stuck(tmp_path))


def test_a_signal_seen_only_by_its_handler_is_caught(tmp_path: Path) -> None:
    """`signal_arrival_unwatched`: the watch thread learns of a signal only from its Python
    handler; the stuck run ends at the collective's timeout (45 s), with its error."""
    caught(check_stuck_stopped, *_stuck(tmp_path, "signal_arrival_unwatched"),
           must=r"the stuck run ended after (4\d|5\d) s with exit code 1")


# -- elastic world size: the global batch is kept ---------------------------------------------------
@dataclass(frozen=True, slots=True)
class Elastic:
    """An elastic run: the step it resumed at (None: not resumed), its accumulation steps, the
    final weights, and each optimizer step's loss (the mean of its micro-batches' process means)."""

    start: int | None
    accum: int
    state: dict[str, torch.Tensor]
    losses: dict[int, float]


def _elastic(folder: str, phase: str) -> Elastic:
    from torch.utils.data import DataLoader

    import shardwise

    engine = shardwise.Engine(strategy="zero3", cpu=True, seed=W.SEED, train_batch_size=8,
                              checkpoint_dir=f"{folder}/checkpoints")
    model = W.build("tiny")
    opt = W.make_optimizer(model)
    model, opt, loader = engine.prepare(model, opt, DataLoader(W.Tokens(32), batch_size=2, shuffle=True))
    start = engine.load_state() if phase == "resume" else None
    losses: dict[int, list[float]] = {}
    while engine.step < 4:
        for ids in loader:
            with engine.accumulate(model):
                loss = W.lm_loss(model, ids)
                engine.backward(loss)
                opt.step()
                opt.zero_grad()
            losses.setdefault(engine.step if engine.sync_gradients else engine.step + 1, []).append(
                engine.reduce(loss.detach(), "mean").item())
            if phase == "save" and engine.step == 2 and engine.sync_gradients:
                engine.save_state()
            if engine.step == 4:
                break
    return Elastic(start, engine.config.training.grad_accum_steps, engine.get_state_dict(model),
                   {k: sum(v) / len(v) for k, v in losses.items()})


def test_a_checkpoint_at_4_processes_resumes_at_2_keeping_the_global_batch(tmp_path: Path) -> None:
    four = spawn(_elastic, 4, str(tmp_path), "save")[0]
    two = spawn(_elastic, 2, str(tmp_path), "resume")[0]
    assert four.accum == 1 and two.accum == 2 and two.start == 2
    assert sorted(two.losses) == [3, 4]
    assert W.close([two.losses[k] for k in (3, 4)], [four.losses[k] for k in (3, 4)]) < 1e-5
    assert W.max_diff(two.state, four.state) < 2e-5
    assert W.max_diff(two.state, W.build("tiny").state_dict()) > 1e-3


# -- the launcher is SIGKILLed: its workers stop at a boundary, after a checkpoint ------------------
def test_workers_stop_when_their_launcher_dies(tmp_path: Path) -> None:
    config = _config(tmp_path, strategy="zero2")
    proc = _start_slow(config, tmp_path, steps=2)

    def workers() -> list[str]:
        found = subprocess.run(["pgrep", "-f", f"{SCRIPT} {tmp_path}"], check=False, capture_output=True,
                               text=True)
        return [pid for pid in found.stdout.split() if int(pid) != proc.pid]

    assert len(workers()) == 2
    proc.kill()  # the launcher dies without a word, as under the OOM killer
    proc.communicate()
    t0 = time.monotonic()
    while time.monotonic() - t0 < 30 and workers():
        time.sleep(0.2)
    gone_after = time.monotonic() - t0
    assert gone_after < 10, gone_after  # within seconds: the watch polls every second, a step takes 0.4 s
    steps = sorted(int(p.name.split("_")[1]) for p in (tmp_path / "checkpoints").glob("step_*"))
    assert steps and steps[-1] >= 2  # they stopped at a boundary, after a checkpoint


# -- what `load_state()` does when it finds nothing: the `resume` setting ---------------------------
def _prepared(folder: Path, **settings: Any) -> tuple[Any, Any, Any, Any]:
    from torch.utils.data import DataLoader

    import shardwise

    engine = shardwise.Engine(cpu=True, seed=W.SEED, checkpoint_dir=str(folder / "ckpt"), **settings)
    model = W.build("tiny")
    model, opt, loader = engine.prepare(model, W.make_optimizer(model),
                                        DataLoader(W.Tokens(16), batch_size=2))
    return engine, model, opt, loader


def _train(engine: Any, model: Any, opt: Any, loader: Any, steps: int) -> None:
    while engine.step < steps:
        for ids in loader:
            with engine.accumulate(model):
                engine.backward(W.lm_loss(model, ids))
                opt.step()
                opt.zero_grad()
            if engine.step >= steps:
                break


def test_load_state_says_what_it_found_and_obeys_resume(tmp_path: Path, capfd: pytest.CaptureFixture[str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    check_resume_rules(tmp_path, capfd, monkeypatch)


def test_a_restart_that_starts_from_zero_is_caught(tmp_path: Path, capfd: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    with planted_here("restart_from_zero"):
        caught(check_resume_rules, tmp_path, capfd, monkeypatch,
               must=r"DID NOT RAISE .*CheckpointError")  # restart 1 finding nothing starts from 0


def check_resume_rules(tmp_path: Path, capfd: pytest.CaptureFixture[str],
                       monkeypatch: pytest.MonkeyPatch) -> None:
    from shardwise.checkpoint.storage import CheckpointError
    from shardwise.runtime.supervision import read_run_record

    engine, *_ = _prepared(tmp_path)
    assert engine.load_state() is None  # a typo'd or empty checkpoint_dir: said, not silent
    assert (f"shardwise: no checkpoint under {tmp_path / 'ckpt'}/: starting at step 0"
            in capfd.readouterr().err)
    engine, *_ = _prepared(tmp_path, resume="required")
    with pytest.raises(CheckpointError, match=r"^no checkpoint under .*ckpt/ and resume: required: "
                                              r"check checkpoint_dir"):
        engine.load_state()
    # a restart of a `--max-restarts` launch whose earlier attempt saved: none found is an error
    record = tmp_path / "record.jsonl"
    record.write_text('{"attempt": 0, "step": 4, "seconds": 0.1, "path": "elsewhere/step_4", "stop": ""}\n')
    monkeypatch.setenv("SHARDWISE_RUN_RECORD", str(record))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    engine, *_ = _prepared(tmp_path)
    with pytest.raises(CheckpointError, match=r"^restart 1: an earlier attempt saved elsewhere/step_4 "
                                              r"\(step 4\), "
                                              r"but there is no checkpoint under .*ckpt/ now"):
        engine.load_state()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")  # the first attempt of a launch starts afresh
    engine, model, opt, loader = _prepared(tmp_path, resume="never")
    _train(engine, model, opt, loader, 1)
    engine.save_state()
    # saves noted
    assert [(r["attempt"], r["step"]) for r in read_run_record(str(record))] == [(0, 4), (0, 1)]
    engine, *_ = _prepared(tmp_path, resume="never")
    capfd.readouterr()
    assert engine.load_state() is None and engine.step == 0  # a checkpoint exists; never loads nothing
    assert "resume: never: no checkpoint loaded" in capfd.readouterr().err


# -- checkpoint_every_steps saves the last step too, at end_training() ------------------------------
def test_the_checkpoint_policy_saves_the_final_step(tmp_path: Path) -> None:
    check_final_step_saved(tmp_path)


def test_a_policy_that_forgets_the_final_step_is_caught(tmp_path: Path) -> None:
    with planted_here("final_step_unsaved"):
        caught(check_final_step_saved, tmp_path,
               must=r"^checkpoints after end_training at step 4: \['step_3'\]")


def check_final_step_saved(tmp_path: Path) -> None:
    from shardwise.checkpoint.sharded import step_dirs

    engine, model, opt, loader = _prepared(tmp_path, checkpoint_every_steps=3)
    _train(engine, model, opt, loader, 4)
    weights = {k: v.clone() for k, v in engine.get_state_dict(model).items()}
    engine.end_training()
    saved = [p.name for p in step_dirs(tmp_path / "ckpt")]
    assert saved == ["step_3", "step_4"], f"checkpoints after end_training at step 4: {saved}"
    again, model, *_ = _prepared(tmp_path, checkpoint_every_steps=3)
    assert again.load_state() == 4 and _identical(again.get_state_dict(model), weights)
    before = sorted((p.name, p.stat().st_mtime_ns) for p in (tmp_path / "ckpt" / "step_4").iterdir())
    again.end_training()  # nothing new to save: step 4 is there already
    assert sorted((p.name, p.stat().st_mtime_ns) for p in (tmp_path / "ckpt" / "step_4").iterdir()) == before


# -- a loop with neither a prepared DataLoader nor accumulate() reaches the boundary too ----------
def _plain_loop(folder: str) -> None:
    import torch.distributed as dist

    import shardwise

    engine = shardwise.Engine(strategy="zero2", cpu=True, seed=W.SEED, checkpoint_dir=f"{folder}/checkpoints",
                              checkpoint_every_steps=2, preempt_signals=("SIGUSR1",))
    model = W.build("tiny")
    model, opt = engine.prepare(model, W.make_optimizer(model))
    data = W.Tokens(16).data
    for step in range(6):
        if step == 3 and dist.get_rank() == 1:  # a preemption notice to one process, after step 3
            os.kill(os.getpid(), signal.SIGUSR1)
        engine.backward(W.lm_loss(model, data[2 * step: 2 * step + 2]))  # its forward: the boundary
        opt.step()
        opt.zero_grad()


def test_a_plain_loop_checkpoints_by_policy_and_stops_on_preemption(tmp_path: Path) -> None:
    """No DataLoader, no accumulate(): the training forward is the step boundary. The policy saves
    step 2; the signal to one process after step 3 is agreed at the next boundary and acted on at
    the one after: both stop with step 4 saved (75)."""
    with pytest.raises(RuntimeError, match=r"workers exited with \[75, 75\]"):
        spawn(_plain_loop, 2, str(tmp_path))
    steps = sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*") if (p / "meta.json").is_file())
    assert steps == ["step_2", "step_4"]


def test_the_launchers_failure_line_carries_the_workers_error(tmp_path: Path) -> None:
    """A worker that raises (no `@record` in the script): the launcher's line names it with the
    error's last line, and no run lock is left behind."""
    run = _run(_config(tmp_path, strategy="ddp", collective_timeout_s=15), tmp_path, fault="raise:2:1",
               timeout=120)
    assert run.returncode == 1, run.stderr[-3000:]
    assert "shardwise launch: rank 1 (local rank 1, pid " in run.stderr
    assert ") exited with code 1: ValueError: bad batch in step 2" in run.stderr, run.stderr[-3000:]
    assert not (tmp_path / "checkpoints" / ".shardwise.lock").exists()


# -- a GPU's hung collective: the process blocks in a device sync, the hang watch ends it ---------
HANG_TIMEOUT = 8


def _device_stuck(folder: Path, planted_fault: str | None = None) -> tuple[int | None, str, float]:
    """tests/scripts/resilient.py with every rank blocked at step 3 as on a GPU whose collective
    hung (a wait for the device that never returns, in no collective: nothing times out by
    itself), `hang_watch: true` on these CPU processes: (exit code, stderr, seconds from the
    block to the exit)."""
    config = _config(folder, strategy="zero3", checkpoint_every_steps=1, collective_timeout_s=HANG_TIMEOUT,
                     supervision={"hang_watch": True})
    env = fault_env(planted_fault, _env("device:3")) if planted_fault else _env("device:3")
    return _blocked(config, folder, env, "device", HANG_TIMEOUT + 30, "every rank blocked")


def check_device_hang_ended(code: int | None, err: str, took: float, folder: Path) -> None:
    """Ended by the hang watch within collective_timeout_s (+ 10 s for the launcher): exit
    non-zero, each rank's one line as a gloo timeout's, the newest checkpoint whole."""
    from shardwise.checkpoint.sharded import newest, verify

    assert took <= HANG_TIMEOUT + 10 and code not in (0, None), \
        (f"the run blocked in the device ended after {took:.0f} s with exit code {code}: "
         f"{err.strip().splitlines()[:1]}")
    for rank in range(2):
        line = (f"shardwise: error: rank {rank}: step 3: a collective did not complete within "
                f"collective_timeout_s={HANG_TIMEOUT} s")
        assert line in err, err[-3000:]
    assert newest(folder / "checkpoints") == folder / "checkpoints" / "step_2"
    assert len(verify(folder / "checkpoints" / "step_2")) >= 5


def test_a_hung_gpu_collective_ends_the_run_with_the_timeouts_line(tmp_path: Path) -> None:
    check_device_hang_ended(*_device_stuck(tmp_path), tmp_path)


def test_planted_hang_unwatched_is_caught(tmp_path: Path) -> None:
    """`hang_unwatched`: no hang watch; the blocked processes wait on until the test's bound."""
    caught(check_device_hang_ended, *_device_stuck(tmp_path, "hang_unwatched"), tmp_path,
           must=r"the run blocked in the device ended after \d+ s with exit code -?\d+: "
                r"\['\(still running 38 s")
