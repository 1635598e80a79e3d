"""One run per checkpoint folder: the run lock.

Two runs started with the same `checkpoint_dir` would write each other's `step_<N>` and resume
each other's state. So a run owns its checkpoint folder while it runs: process 0 creates
`<checkpoint_dir>/.shardwise.lock` (JSON: host, pid, the process's start time, the
machine's boot id, torchrun's job id and restart count) when the run first needs the folder: its
first `load_state()` (found a checkpoint or not: scripts call it at their start) or its first save
there, whichever comes first (an Accelerator's automatic `checkpoint_<i>` naming: the same, for
`<project_dir>/checkpoints`). Saves and loads of an explicit folder outside checkpoint_dir take
no lock: the user named that folder.

The file is made atomically (written under a temporary name, then hard-linked into place, which
fails if a lock is there), and removed at interpreter exit (atexit: a normal end, an exception,
sys.exit). While the run lives, a thread of process 0 touches the file every lease / 10 seconds
(its heartbeat: the file's modification time, as the file server sets it). A run killed outright
(SIGKILL, SIGTERM without a handler, a node lost) leaves it; the next run takes it over, saying
in one line which rule allowed it, only from a holder that is provably gone:
  1. a later attempt of the same scheduler job: a SLURM requeue (same SLURM_JOB_ID, a higher
     SLURM_RESTART_COUNT: SLURM requeues a job only after all its processes are gone) or a
     torchrun `--max-restarts` relaunch (same run id, a higher restart count), whichever machine
     its process 0 is on now;
  2. a heartbeat older than `lock_lease_s` (the age is the file server's clock against itself:
     a probe file written beside the lock, so the hosts' clocks do not matter);
  3. on this host and boot: a pid that is gone or now belongs to a process started at another
     time (/proc/<pid>/stat), or a reboot since.
Any other holder is alive as far as anyone can tell, and is never taken over: two runs writing
one folder is the failure this lock exists to prevent. Kubernetes' `Lease` objects and
torchelastic's keep-alive work the same way.

Process 0 decides and every process raises the same one line (`storage.agree`), before the
save or load starts.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

from .run_record import attempt
from .storage import agree, one_line

log = logging.getLogger("shardwise")
LOCK = ".shardwise.lock"
_held: dict[str, bool] = {}  # abspath of a checkpoint folder this process's run owns -> it made the folder
_registered = False
DEFAULT_LEASE_S = 300.0


def _start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22), None
    when there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])  # fields after "(comm)" start at field 3


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _slurm() -> tuple[str, int]:
    """(SLURM_JOB_ID, SLURM_RESTART_COUNT) of this process ("" outside SLURM)."""
    restart = os.environ.get("SLURM_RESTART_COUNT", "0").strip()
    return os.environ.get("SLURM_JOB_ID", "").strip(), int(restart) if restart.isdigit() else 0


def _me() -> dict[str, Any]:
    pid = os.getpid()
    job, restart = _slurm()
    return {"host": socket.gethostname(), "pid": pid, "start_ticks": _start_ticks(pid), "boot_id": _boot_id(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "job": os.environ.get("TORCHELASTIC_RUN_ID", ""), "attempt": attempt(),
            "slurm_job": job, "slurm_restart": restart}


def _same_process(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(a.get(k) == b.get(k) for k in ("host", "pid", "start_ticks", "boot_id"))


def _holder(info: dict[str, Any]) -> str:
    return f"host {info.get('host')}, pid {info.get('pid')}, started {info.get('started')}"


def heartbeat_age(lock: Path) -> float | None:
    """Seconds since the lock's holder last touched it, on the file server's clock (a probe file
    written beside it now, against the lock's modification time); None when it is gone."""
    probe = lock.with_name(f"{LOCK}.{os.getpid()}.probe")
    try:
        probe.write_text("")
        now = probe.stat().st_mtime
        return max(0.0, now - lock.stat().st_mtime)
    except FileNotFoundError:
        return None
    finally:
        probe.unlink(missing_ok=True)


def _gone(info: dict[str, Any], lock: Path, lease_s: float) -> str | None:
    """Why the holder is provably not running (the rule that allows a takeover), or None.

    1. A later attempt of the same scheduler job: SLURM requeues a job only after all its
       processes are gone; torchrun stops every worker before it restarts them (process 0 may
       now be on another machine). 2. Its heartbeat is older than the lease. 3. On this host:
       the machine was rebooted since, or its pid is gone, or the pid now names a process
       started at another time."""
    job, restart = _slurm()
    held_restart = info.get("slurm_restart")
    if job and info.get("slurm_job") == job and isinstance(held_restart, int) and held_restart < restart:
        return f"a later attempt of SLURM job {job} (restart {restart}; the lock's: {held_restart})"
    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    held_attempt = info.get("attempt")
    if (run not in ("", "none") and info.get("job") == run and isinstance(held_attempt, int)
            and held_attempt < attempt()):
        return f"a later attempt of torchrun run {run} (restart {attempt()}; the lock's: {held_attempt})"
    age = heartbeat_age(lock)
    if age is not None and age > lease_s:
        return f"its heartbeat stopped {age:.0f} s ago (lock_lease_s {lease_s:g})"
    if info.get("host") != socket.gethostname() or not isinstance(info.get("pid"), int):
        return None
    if info.get("boot_id") and info["boot_id"] != _boot_id():
        return "this host was rebooted since"
    ticks = _start_ticks(info["pid"])
    if ticks is None or ticks != info.get("start_ticks"):
        return "its process is gone from this host"
    return None


def _create(lock: Path, me: dict[str, Any]) -> bool:
    """Create `lock` holding `me`, atomically: False when a lock is already there."""
    tmp = lock.with_name(f"{LOCK}.{me['pid']}.tmp")
    tmp.write_text(json.dumps(me))
    try:
        os.link(tmp, lock)  # fails with EEXIST when another run made it first
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink()


def _read(lock: Path) -> dict[str, Any] | None:
    try:
        info = json.loads(lock.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError, UnicodeDecodeError):
        return {}
    return info if isinstance(info, dict) else {}


def _acquire(root: Path, lease_s: float) -> tuple[str | None, str | None]:
    """Process 0: take the lock on `root`; (the refusal, the takeover line), at most one set."""
    lock = root / LOCK
    me = _me()
    made = not root.is_dir()
    root.mkdir(parents=True, exist_ok=True)
    taken_over = None
    for _ in range(3):  # a lock removed or replaced between our look and our move: look again
        if _create(lock, me):
            _held[os.path.abspath(root)] = made
            return None, taken_over
        info = _read(lock)
        if info is None:
            continue
        if _same_process(info, me):  # this process's run already owns it (a second Engine)
            _held[os.path.abspath(root)] = False
            return None, None
        if not info:
            return (f"{lock}: unreadable run lock; if no run uses {root}, delete {lock} by hand, "
                    "or give this run another checkpoint_dir"), None
        rule = _gone(info, lock, lease_s)
        if rule is None:
            if info.get("host") != socket.gethostname():
                age = heartbeat_age(lock)
                beat = "" if age is None else f", its heartbeat {age:.0f} s old"
                return (
                    f"{root}: held by a run on another machine ({_holder(info)}{beat}): it is alive or "
                    f"died less than lock_lease_s={lease_s:g} s ago; wait for it to end (a dead run's "
                    "lock is taken over once its lease expires), or give this run another checkpoint_dir"
                ), None
            return (f"{root}: in use by another run ({_holder(info)}); two runs in one checkpoint folder "
                    "overwrite each other's checkpoints: wait for it to end, or give this run another "
                    "checkpoint_dir"), None
        # a dead holder: move its lock aside under a name of our own, and check it is the one we
        # judged (another run may have taken it over in between: then put theirs back)
        aside = lock.with_name(f"{LOCK}.{me['pid']}.stale")
        try:
            os.rename(lock, aside)
        except FileNotFoundError:
            continue
        if _read(aside) != info:
            os.rename(aside, lock)
            continue
        aside.unlink()
        taken_over = one_line(
            f"{lock}: took over the run lock from a run that is no longer alive ({_holder(info)}): {rule}"
        )
    return (
        f"{lock}: could not take the run lock (other runs keep replacing it); give this run another "
        "checkpoint_dir"
    ), None


def _beat(key: str, lease_s: float) -> None:
    """Process 0's heartbeat: touch the lock every lease / 10 seconds while this run holds it
    (the thread ends when the lock is released, or the lock is no longer this process's)."""
    lock, me = Path(key) / LOCK, _me()
    period = max(0.05, lease_s / 10)
    while key in _held:
        time.sleep(period)
        info = _read(lock)
        if key not in _held or not info or not _same_process(info, me):
            return
        with contextlib.suppress(OSError):
            os.utime(lock)


def hold(root: Path, rank: int, lease_s: float = DEFAULT_LEASE_S) -> str | None:
    """Own the checkpoint folder `root` for this run (a collective: every process calls it; a
    no-op once owned). Raises the same CheckpointError on every process when another live run
    owns it; returns the line said when a dead run's lock was taken over (on process 0)."""
    key = os.path.abspath(root)
    if key in _held:
        return None
    error, taken_over = None, None
    if rank == 0:
        try:
            error, taken_over = _acquire(Path(key), lease_s)
        except OSError as err:
            error = one_line(f"{root}: could not take the run lock: {err.strerror or err}; "
                             "make the folder writable, or give this run another checkpoint_dir")
        if taken_over:
            log.warning(taken_over)
    agree(error)
    _held.setdefault(key, False)
    if rank == 0:
        threading.Thread(target=_beat, args=(key, lease_s), name="shardwise-lock-heartbeat",
                         daemon=True).start()
    global _registered
    if rank == 0 and not _registered:
        atexit.register(release_all)
        _registered = True
    return taken_over


def hold_for(root: Path | None, folder: Path, rank: int, lease_s: float = DEFAULT_LEASE_S) -> None:
    """`hold(root)` when `folder` (a checkpoint saved or loaded) is inside the run's checkpoint
    folder `root`; a folder elsewhere was named by the user and needs no lock."""
    if root is not None and Path(os.path.abspath(root)) in Path(os.path.abspath(folder)).parents:
        hold(root, rank, lease_s)


def release_all() -> None:
    """Remove this process's run locks (at exit; only a lock that still names this process), and
    a checkpoint folder the lock created that stayed empty."""
    me = _me()
    for key, made in list(_held.items()):
        lock = Path(key) / LOCK
        info = _read(lock)
        if info and _same_process(info, me):
            lock.unlink(missing_ok=True)
            if made:
                with contextlib.suppress(OSError):  # not empty: it holds checkpoints now
                    os.rmdir(key)
        del _held[key]

