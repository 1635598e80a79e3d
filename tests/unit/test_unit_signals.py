"""A process forked from one that runs an Engine (a DataLoader worker, a multiprocessing pool's
worker) is not preempted by shardwise's handler: SIGTERM ends it as it would without shardwise.
(Found when a forked pool's terminate() waited forever on a worker that had inherited the
handler of a process past its first step: the worker kept running, waiting for a boundary.)"""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from shardwise.runtime.supervision import _Process


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork (POSIX)")
def test_a_forked_child_takes_sigterms_default_action() -> None:
    process = _Process()
    process.install(("SIGTERM",), grace=60.0, rank=0)
    process.stepping = True  # past the first step: in the owner, a signal means "save and stop"
    try:
        pid = os.fork()
        if pid == 0:  # the child: wait to be signalled
            time.sleep(30)
            os._exit(0)
        time.sleep(0.2)
        os.kill(pid, signal.SIGTERM)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM
        assert not process.preempted  # the owner saw nothing
    finally:
        for signum, previous in process.handlers.items():
            signal.signal(signum, previous)
        sys.excepthook = process.previous_hook or sys.__excepthook__
