"""A SLURM job whose nodes die (every process SIGKILLed, its run lock left behind), requeued on
another host with no hand work; and an unrelated run on the same checkpoints, which must wait for
the dead run's lease.

A faked job of 2 nodes x 2 processes on this machine (two `shardwise launch` processes with the
variables srun sets, tests/test_clusters.py's `_scheduler_env`), tests/scripts/resilient.py under
zero3 with checkpoint_every_steps 2, slowed down, is SIGKILLed whole after step 5 (`os.killpg` of
each launcher's session and of each worker's: torchrun starts every worker in a session of its
own; `.shardwise.lock` stays, naming this host, the job and restart 0). A copy of the crashed
folder (lock and heartbeat time included) is the same crash for the second half.
- The requeue: the same SLURM_JOB_ID, SLURM_RESTART_COUNT=1, both launchers on another host name
  (`unshare --uts --mount`, tests/test_clusters.py's `_RENAME`: required; the host name is
  recorded and asserted to differ). Node 0 says one line, "took over the run lock ... a later
  attempt of SLURM job <id> (restart 1; the lock's: 0)", the run resumes from the newest
  checkpoint, ends bit-identical (every step's loss, torch.equal final weights) to the
  uninterrupted job, and leaves no lock.
- An unrelated job (another SLURM_JOB_ID) on another host name: under the default lease
  (lock_lease_s 300 s) it is refused with the same one line on its 4 processes ("held by a run on
  another machine ... its heartbeat N s old ... lock_lease_s=300 s"; the heartbeat is younger
  than the lease: about 40 s here), nothing in the folder changes; relaunched with lock_lease_s 3
  once the heartbeat is older than 3 s, it takes over ("its heartbeat stopped N s ago
  (lock_lease_s 3)"), resumes and ends bit-identical too. (The lease is the new run's setting; a
  live holder, whose heartbeat keeps moving, is never taken over: tests/test_run_lock.py.)
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import workloads as W
import yaml
from planted import caught, fault_env
from spawn import wait_for_launchers
from test_clusters import (
    _RENAME,
    LAUNCH_TIMEOUT_S,
    RESILIENT,
    _base_env,
    _check_can_rename_host,
    _scheduler_env,
    _slurm_job_id,
)

sys.path.insert(0, str(RESILIENT.parent))
from resilient import read_losses

LOCK = ".shardwise.lock"


def _config(folder: Path, **extra: Any) -> None:
    folder.mkdir(exist_ok=True)
    (folder / "shardwise.yaml").write_text(yaml.safe_dump({
        "cpu": True, "seed": W.SEED, "strategy": "zero3", "checkpoint_every_steps": 2,
        "checkpoint_dir": str(folder / "checkpoints"), **extra}))


def _launch(folder: Path, job: int, restart: int = 0, *, fault: str = "",
            elsewhere: bool = False, planted_fault: str | None = None) -> list[subprocess.Popen[str]]:
    """Node 0's and node 1's launchers of SLURM job `job` (restart count `restart`), each in a
    session of its own; `elsewhere`: each on the host name `requeued-node`, written to
    <folder>/host<node>. (`fault`: the script's own, tests/scripts/resilient.py; `planted_fault`:
    one of tests/planted.py, planted in the launchers and workers.)"""
    procs = []
    for node in (0, 1):
        env = _base_env(**_scheduler_env("slurm", node, job, 0), SLURM_RESTART_COUNT=str(restart),
                        SHARDWISE_TEST_FAULT=fault)
        env = fault_env(planted_fault, env) if planted_fault else env
        cmd = [sys.executable, "-m", "shardwise", "launch", str(RESILIENT), str(folder)]
        if elsewhere:
            rename = f'{_RENAME} && hostname > "{folder / f"host{node}"}" && exec "$@"'
            cmd = ["unshare", "--uts", "--mount", "sh", "-c", rename, "sh", *cmd]
        procs.append(subprocess.Popen(cmd, cwd=folder, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, start_new_session=True))
    return procs


def _job(folder: Path, job: int, restart: int = 0, *, elsewhere: bool = False,
         planted_fault: str | None = None) -> tuple[list[int | None], str]:
    codes, outs = wait_for_launchers(_launch(folder, job, restart, elsewhere=elsewhere,
                                             planted_fault=planted_fault), LAUNCH_TIMEOUT_S)
    if elsewhere:
        hosts = {(folder / f"host{node}").read_text().strip() for node in (0, 1)}
        assert hosts == {"requeued-node"} and socket.gethostname() != "requeued-node", hosts
    return codes, "\n".join(outs)


def _crash(folder: Path, job: int) -> int:
    """The job, slowed down, SIGKILLed whole once it has logged step 5; the newest checkpoint's step."""
    from shardwise.checkpoint.sharded import newest

    procs = _launch(folder, job, fault="slow:0.4")
    losses = folder / "losses.jsonl"
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    while time.monotonic() < deadline and not (losses.is_file()
                                               and len(losses.read_text().splitlines()) >= 5):
        time.sleep(0.05)
    # the nodes die: every launcher and worker at once, no handler runs (torchrun starts each
    # worker in a session of its own: the launchers' sessions, then each worker's)
    workers = [int(pid) for pid in _left(folder).split() if int(pid) not in {p.pid for p in procs}]
    assert len(workers) == 4, workers
    for p in procs:
        os.killpg(p.pid, signal.SIGKILL)
    for pid in workers:
        os.killpg(pid, signal.SIGKILL)
    for p in procs:
        p.communicate(timeout=60)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _left(folder):
        time.sleep(0.2)
    assert not _left(folder), _left(folder)
    lock = json.loads((folder / "checkpoints" / LOCK).read_text())  # left behind
    assert (lock["host"], lock["slurm_job"], lock["slurm_restart"]) == (socket.gethostname(), str(job), 0), \
        lock
    last = newest(folder / "checkpoints")
    assert last is not None, sorted(os.listdir(folder / "checkpoints"))
    step = int(last.name.split("_")[1])
    assert step >= 4, step
    return step


def _left(folder: Path) -> str:
    found = subprocess.run(["pgrep", "-f", f"{RESILIENT} {folder}"], check=False, capture_output=True,
                           text=True)
    return found.stdout.strip()


def _check_bit_identical(folder: Path, straight: Path) -> None:
    ref_losses, ref_state = read_losses(straight), torch.load(straight / "final.pt", weights_only=True)
    rows = [json.loads(line) for line in (folder / "losses.jsonl").read_text().splitlines()]
    wrong = [(r["step"], r["loss"]) for r in rows if r["loss"] != ref_losses[r["step"]]]
    assert not wrong and read_losses(folder) == ref_losses, (wrong, read_losses(folder), ref_losses)
    state = torch.load(folder / "final.pt", weights_only=True)
    assert state.keys() == ref_state.keys() and all(torch.equal(state[k], ref_state[k]) for k in state)


def check_requeue_takes_over(codes: list[int | None], out: str, lock: Path, held: dict[str, Any], job: int,
                             step: int) -> None:
    """The requeued job took the dead attempt's lock over, said so once, and resumed at `step`
    (the take-over line first: a job that failed for another reason is not this finding)."""
    errors = [ln for ln in out.splitlines() if "Error: " in ln and not ln.startswith("shardwise launch:")]
    holder = f"host {held['host']}, pid {held['pid']}, started {held['started']}"
    took = _took_over(out)  # said once, by process 0, in one line
    refused = [ln for ln in errors if "held by a run on another machine" in ln]
    assert took or not refused, f"the requeued job was refused the lock: {refused[0]}"
    assert len(took) == 1 and took[0].endswith(
        f"{lock}: took over the run lock from a run that is no longer alive ({holder}): "
        f"a later attempt of SLURM job {job} (restart 1; the lock's: 0)"), took or out[-4000:]
    assert codes == [0, 0], f"exit codes {codes}: {errors[0] if errors else ''}\n{out[-4000:]}"
    assert f"attempt 0: starting at step {step}" in out, out[-4000:]
    assert not lock.exists()


def test_planted_slurm_restart_unread_is_caught(tmp_path: Path) -> None:
    """`slurm_restart_unread`: the lock no longer reads SLURM's restart count, so the requeued job
    on another host is not known as a later attempt of the crashed one; refused under the lease."""
    _check_can_rename_host()
    job, crashed = _slurm_job_id(), tmp_path / "crashed"
    _config(crashed)
    step = _crash(crashed, job)
    lock = crashed / "checkpoints" / LOCK
    held = json.loads(lock.read_text())
    codes, out = _job(crashed, job, restart=1, elsewhere=True, planted_fault="slurm_restart_unread")
    caught(check_requeue_takes_over, codes, out, lock, held, job, step,
           must=r"^the requeued job was refused the lock: .*held by a run on another machine .*"
                r"it is alive or died less than lock_lease_s=300 s ago")


def _took_over(out: str) -> list[str]:
    return [ln for ln in out.splitlines() if "took over the run lock" in ln]


def test_a_crashed_slurm_job_requeued_on_another_host_takes_over_its_lock(tmp_path: Path) -> None:
    _check_can_rename_host()
    t0 = time.monotonic()
    job = _slurm_job_id()
    straight, crashed, unrelated = tmp_path / "straight", tmp_path / "crashed", tmp_path / "unrelated"
    _config(straight)
    _config(crashed)
    codes, out = _job(straight, job)  # the job uninterrupted
    assert codes == [0, 0], out[-4000:]
    assert not (straight / "checkpoints" / LOCK).exists()

    step = _crash(crashed, job)
    shutil.copytree(crashed, unrelated, symlinks=True)  # the same crash (the lock's time kept)
    _config(unrelated)  # lock_lease_s: the default, 300 s
    lock = crashed / "checkpoints" / LOCK
    held = json.loads(lock.read_text())

    # the requeue: same job, next restart count, another host; no hand work
    codes, out = _job(crashed, job, restart=1, elsewhere=True)
    check_requeue_takes_over(codes, out, lock, held, job, step)
    holder = f"host {held['host']}, pid {held['pid']}, started {held['started']}"
    _check_bit_identical(crashed, straight)
    print(f"crashed after step 5 (newest checkpoint step {step}), requeued on 'requeued-node': took over, "
          f"bit-identical ({time.monotonic() - t0:.0f} s)")

    # an unrelated job on another host: refused while the dead run's lease holds ...
    other = _slurm_job_id(after=job)
    lock, before = unrelated / "checkpoints" / LOCK, sorted(os.listdir(unrelated / "checkpoints"))
    codes, out = _job(unrelated, other, elsewhere=True)
    assert codes[0] != 0 and codes[1] != 0, out[-4000:]
    said = {ln.split("CheckpointError: ", 1)[1] for ln in out.splitlines()
            if "CheckpointError: " in ln and not ln.startswith("shardwise launch:")}
    assert len(said) == 1, said  # one line, the same on every process
    refusal = said.pop()
    assert refusal.startswith(f"{unrelated / 'checkpoints'}: held by a run on another machine ({holder}, "
                              "its heartbeat "), refusal
    assert "died less than lock_lease_s=300 s ago" in refusal, refusal
    ranks = {r for r in range(4) if any(f"[rank{r}]" in ln and refusal in ln for ln in out.splitlines())}
    assert ranks == {0, 1, 2, 3}, out[-4000:]
    assert json.loads(lock.read_text()) == held and sorted(os.listdir(unrelated / "checkpoints")) == before
    assert not _took_over(out)
    # ... taken over once it has expired (the lease the new run's config sets)
    _config(unrelated, lock_lease_s=3)
    from shardwise.checkpoint.runlock import heartbeat_age

    while (heartbeat_age(lock) or 0) <= 3.5:
        time.sleep(0.2)
    codes, out = _job(unrelated, other, elsewhere=True)
    assert codes == [0, 0], out[-4000:]
    took = _took_over(out)
    assert len(took) == 1 and (f"{lock}: took over the run lock from a run that is no longer alive "
                               f"({holder}): its heartbeat stopped ") in took[0], took or out[-4000:]
    assert took[0].endswith(" s ago (lock_lease_s 3)"), took
    assert f"attempt 0: starting at step {step}" in out and not lock.exists()
    _check_bit_identical(unrelated, straight)
    print(f"an unrelated job: refused while the lease held ({refusal.split('(', 1)[1].split(')')[0]}), "
          f"took over once it expired, bit-identical ({time.monotonic() - t0:.0f} s)")
