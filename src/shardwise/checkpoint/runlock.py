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
sys.exit). A run killed outright (SIGKILL, SIGTERM without a handler, a node lost) leaves it;
the next run takes it over only from a holder that is provably dead: an earlier attempt of
the same torchrun job (a `--max-restarts` relaunch, whichever machine its process 0 is on now),
or on this host and boot, a pid that is gone or now belongs to a process started at another
time (/proc/<pid>/stat). Any other holder on another host cannot be checked from here and is
never taken over: the refusal says how to remove the lock by hand.

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
import time
from pathlib import Path
from typing import Any

from .run_record import attempt
from .storage import agree, one_line

log = logging.getLogger("shardwise")
LOCK = ".shardwise.lock"
_held: dict[str, bool] = {}  # abspath of a checkpoint folder this process's run owns -> it made the folder
_registered = False


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


def _me() -> dict[str, Any]:
    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid, "start_ticks": _start_ticks(pid), "boot_id": _boot_id(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "job": os.environ.get("TORCHELASTIC_RUN_ID", ""), "attempt": attempt()}


def _same_process(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(a.get(k) == b.get(k) for k in ("host", "pid", "start_ticks", "boot_id"))


def _holder(info: dict[str, Any]) -> str:
    return f"host {info.get('host')}, pid {info.get('pid')}, started {info.get('started')}"


def _dead(info: dict[str, Any]) -> bool:
    """True only when the holder is provably not running: an earlier attempt of this torchrun job
    (torchrun stops every worker before it restarts them; process 0 may now be on another
    machine), or on this host: the machine was rebooted since, or its pid is gone, or the pid
    now names a process started at another time."""
    job = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if job not in ("", "none") and info.get("job") == job and isinstance(info.get("attempt"), int):
        return bool(info["attempt"] < attempt())
    if info.get("host") != socket.gethostname() or not isinstance(info.get("pid"), int):
        return False
    if info.get("boot_id") and info["boot_id"] != _boot_id():
        return True
    ticks = _start_ticks(info["pid"])
    return ticks is None or ticks != info.get("start_ticks")


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


def _acquire(root: Path) -> tuple[str | None, str | None]:
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
        if not _dead(info):
            if info.get("host") != socket.gethostname():
                return (
                    f"{root}: held by a run on another machine ({_holder(info)}), which cannot be "
                    f"checked from here; if that run is over, delete {lock} by hand, or give this run "
                    "another checkpoint_dir"
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
            f"{lock}: took over the run lock from a run that is no longer alive ({_holder(info)})"
        )
    return (
        f"{lock}: could not take the run lock (other runs keep replacing it); give this run another "
        "checkpoint_dir"
    ), None


def hold(root: Path, rank: int) -> str | None:
    """Own the checkpoint folder `root` for this run (a collective: every process calls it; a
    no-op once owned). Raises the same CheckpointError on every process when another live run
    owns it; returns the line said when a dead run's lock was taken over (on process 0)."""
    key = os.path.abspath(root)
    if key in _held:
        return None
    error, taken_over = None, None
    if rank == 0:
        try:
            error, taken_over = _acquire(Path(key))
        except OSError as err:
            error = one_line(f"{root}: could not take the run lock: {err.strerror or err}; "
                             "make the folder writable, or give this run another checkpoint_dir")
        if taken_over:
            log.warning(taken_over)
    agree(error)
    _held.setdefault(key, False)
    global _registered
    if rank == 0 and not _registered:
        atexit.register(release_all)
        _registered = True
    return taken_over


def hold_for(root: Path | None, folder: Path, rank: int) -> None:
    """`hold(root)` when `folder` (a checkpoint saved or loaded) is inside the run's checkpoint
    folder `root`; a folder elsewhere was named by the user and needs no lock."""
    if root is not None and Path(os.path.abspath(root)) in Path(os.path.abspath(folder)).parents:
        hold(root, rank)


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

