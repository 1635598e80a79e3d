"""The run lock goes on every way a worker ends, including the supervisor's own `os._exit`s
(which skip atexit): an uncaught collective timeout (exit 1), a signal before the first step
(128 + N), no step boundary within preempt_grace_s (128 + N). The preempted stop after a
checkpoint (exit 75) is proven end to end in tests/test_clusters.py. Each case runs in a forked
child that takes the lock itself (the lock names the process that holds it)."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from shardwise.checkpoint import runlock
from shardwise.runtime.supervision import CollectiveTimeout, _Process

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork (POSIX)")


def _timeout(process: _Process) -> None:
    process._excepthook(CollectiveTimeout, CollectiveTimeout("rank 0: step 2: a collective ..."), None)


def _signal_before_first_step(process: _Process) -> None:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)


def _no_boundary_within_grace(process: _Process) -> None:
    process.stepping = True  # past the first step: the signal asks for a checkpoint that never comes
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)


@pytest.mark.parametrize(("end", "code"), [(_timeout, 1), (_signal_before_first_step, 143),
                                           (_no_boundary_within_grace, 143)],
                         ids=["collective timeout", "signal before the first step", "no boundary in grace"])
def test_the_supervisors_exits_release_the_run_lock(end: Callable[[_Process], None], code: int,
                                                    tmp_path: Path) -> None:
    folder = tmp_path / "checkpoints"
    pid = os.fork()
    if pid == 0:  # the child: hold the lock as a run's process 0 does, then end as the case says
        try:
            sys.stderr = open(os.devnull, "w")  # noqa: SIM115 -- the child's own lines are not asserted
            runlock.hold(folder, 0)
            assert (folder / runlock.LOCK).is_file()
            process = _Process()
            process.install(("SIGTERM",), grace=0.3, rank=0)
            end(process)
        finally:
            os._exit(99)  # not reached when the supervisor exits as it should
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == code, status
    assert not (folder / runlock.LOCK).exists()
