"""The hang watch: a stuck collective on a GPU ends the run with the same line as on CPU.

gloo's collectives block the calling thread, and one that outlasts collective_timeout_s raises
there: the supervisor turns it into one `CollectiveTimeout` line naming the step and the
processes behind. NCCL's are asynchronous: the call returns at once and the process blocks later,
in whatever waits for the device (a `loss.item()`, the next collective's stream), where no timeout
reaches the main thread. NCCL's own watchdog then aborts the process (SIGABRT) with a line about
a `WorkNCCL` sequence number, and the launcher reports a signal.

`HangWatch` is a thread that looks once a second at the engine's heartbeats (a forward, a
backward, a step boundary, a wait for everyone). When the process has made none for
collective_timeout_s while its device still has queued work that does not finish (the current
stream is busy: what a hung NCCL kernel looks like; on CPU, where collectives time out by
themselves, an armed watch takes no progress alone as stuck), it ends the process as a gloo
timeout does: the `CollectiveTimeout` line (the step, who is behind, read from the store), the
launcher's error file, the run lock released, exit 1. A checkpoint cannot be written then: the
step's collectives are stuck and the state is mid-step; a restart (`--max-restarts`) resumes
from the newest checkpoint. NCCL's own timeout is set
`distributed.world.NCCL_BACKSTOP_S` later, so the watch is the one that speaks.

On by default where the device is a GPU (`supervision.hang_watch: null`); `true` arms it on CPU
too, `false` leaves the hang to NCCL's watchdog.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

__all__ = ["HangWatch", "device_busy"]


def device_busy(device: torch.device) -> bool:
    """The device still has queued work (its current stream has not finished). A CPU has no
    queue: its collectives block the caller, so any lack of progress counts as stuck there."""
    if device.type != "cuda":
        return True
    return not torch.cuda.current_stream(device).query()


class HangWatch:
    """One process's watch (see the module docstring); `beat` at every sign of progress."""

    def __init__(self, timeout_s: float, device: torch.device, describe: Callable[[], str],
                 end: Callable[[str], None], period_s: float = 1.0) -> None:
        """`end(line)`: what ends the process (the supervisor's: the line, the launcher's error
        file, the run lock, exit 1)."""
        self.timeout_s, self.device, self.describe, self.end = timeout_s, device, describe, end
        self.period_s = period_s
        self.last = time.monotonic()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="shardwise-hang-watch", daemon=True)
        self.thread.start()

    def beat(self) -> None:
        self.last = time.monotonic()

    def close(self) -> None:
        self._stop.set()

    def stuck(self, now: float) -> bool:
        """No progress for the timeout, and the device's work does not finish."""
        return now - self.last > self.timeout_s and device_busy(self.device)

    def _loop(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # (a thread starts on GPU 0: ask the training's)
        while not self._stop.wait(self.period_s):
            if self.stuck(time.monotonic()):
                self.end(self.describe())
                return
