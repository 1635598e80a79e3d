"""Runs that survive failures: checkpoints by policy, preemption, a launcher that died, hung ranks.

At every optimizer-step boundary (the first thing after an optimizer step, before the next
step's forward: the prepared DataLoader yielding the next batch, the next `accumulate()`, or the
next forward of a prepared model, so a checkpoint there resumes exactly), the Engine's boundary
(`engine.boundary`) asks `Supervisor.at_boundary` for a decision and acts on it through its
checkpoint manager:
  heartbeat   this process's progress goes to the process group's store (`shardwise/progress/<r>`:
              a count of boundaries, forwards and backwards, with the step), also at every
              forward of a prepared model and every `backward()`, so a process whose collective
              times out can say which processes did not arrive;
  agreement   one all-reduce (MAX) of four flags, so every process decides alike (`decide`): a
              preemption signal arrived (on any process), the launcher is gone,
              checkpoint_every_seconds has passed (process 0's clock), a checkpoint written in
              the background failed (`checkpoint_async`: then every process raises its
              CheckpointError). It is issued without waiting and read at the next boundary, so
              an event takes effect at the second boundary after it (every process at the same
              one), and reaching a boundary restarts the preempt_grace_s clock;
  decision    save (every checkpoint_every_steps steps or when the time is due); stop (on
              preemption or a gone launcher: the engine saves the step unless it is saved
              already, waits until it is complete, and `leave` exits with PREEMPTED_EXIT, 75,
              "try again").
Signals: the configured preempt_signals (SIGTERM, SIGUSR1) set a flag. Schedulers (SLURM,
Kubernetes) signal every process of the job at once, and `shardwise launch` passes its own signal
on, so a worker gets the same signal twice or more: the repeats change nothing. A process that
reaches no boundary within preempt_grace_s of the first signal (a hung or stalled process) exits
with 128 + the signal, without saving: the scheduler would kill it anyway. Python runs a signal's
handler only when the main thread comes back to the interpreter, which a main thread waiting in a
collective that never completes does not: so the signal is also seen at the C level, through
`signal.set_wakeup_fd`, by the watch thread (under a launcher), whose preempt_grace_s clock then
runs from the signal's arrival.
The stop goes into the run record of `shardwise launch` (`checkpoint.run_record`) after the saves.
Launcher: a thread notices when the parent process changes (the launcher was SIGKILLed: the
process was handed to init); the run then stops at its next boundary, as on preemption, or
after preempt_grace_s without one.
Hung ranks: the process group's collectives time out after collective_timeout_s; the timeout is
reported as `CollectiveTimeout`, one line naming the step and the processes behind.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import FrameType, TracebackType
from typing import Any

import torch
import torch.distributed as dist

from ..checkpoint import run_record, runlock
from ..checkpoint.run_record import (  # (the launcher reads the run record through these names)
    RUN_RECORD_ENV as RUN_RECORD_ENV,
    read_run_record as read_run_record,
)
from ..checkpoint.storage import CheckpointError
from ..config.tree import CheckpointConfig, SupervisionConfig
from ..distributed.world import DistInfo, host_device
from .hang import HangWatch

log = logging.getLogger("shardwise")

PREEMPTED_EXIT = 75  # EX_TEMPFAIL: the run stopped cleanly after a checkpoint; start it again to continue
_TIMEOUT_MARKERS = ("Timed out waiting", "timed out", "Timeout", "DistStoreError")


def say(info: DistInfo, message: str) -> None:
    """A lifecycle line (resume, checkpoint, preemption) on process 0's stderr, and in the log."""
    log.info(message)
    if info.is_main:
        print(f"shardwise: {message}", file=sys.stderr, flush=True)


class CollectiveTimeout(RuntimeError):
    """A collective did not complete within collective_timeout_s (one line: step, who is behind)."""


def is_timeout(err: BaseException) -> bool:
    return isinstance(err, RuntimeError) and any(m in str(err) for m in _TIMEOUT_MARKERS)


def tell_the_launcher(err: BaseException) -> None:
    """Write `err` to torchrun's error file for this worker (TORCHELASTIC_ERROR_FILE), as its
    `@record` decorator would: `shardwise launch` reads the message's last line."""
    if not os.environ.get("TORCHELASTIC_ERROR_FILE"):
        return
    with contextlib.suppress(Exception):  # (a report, never a second failure)
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        ErrorHandler().record_exception(err)


def _end_stuck(message: str) -> None:
    """The hang watch's end of a process stuck in its device: the timeout's one line, the
    launcher's error file, the run lock released, exit 1 (the main thread cannot be reached)."""
    print(f"shardwise: error: {message}", file=sys.stderr, flush=True)
    tell_the_launcher(CollectiveTimeout(message))
    runlock.release_all()  # os._exit skips atexit, where the run lock goes
    sys.stdout.flush()
    os._exit(1)


class _Process:
    """What this process has seen (signals, its launcher), shared by every Engine in it: the
    handlers and the watch thread are installed once per process."""

    def __init__(self) -> None:
        self.preempted = 0  # the signal that asked to stop (0: none)
        self.launcher_gone = False
        self.since = 0.0  # when either happened
        self.at_boundary = False  # a checkpoint on the way out is being written
        self.stepping = False  # a step boundary was reached: from then on a signal means a checkpoint
        self.grace = 25.0
        self.rank = 0
        self.handlers: dict[int, Any] = {}
        self.parent = os.getppid()
        self.watch: threading.Thread | None = None
        self.under_launcher = False  # started by torchrun: a launcher to outlive
        self.supervisor: Supervisor | None = None  # the newest Engine's: it reports an uncaught timeout
        self.previous_hook: Callable[..., Any] | None = None
        self.pid = os.getpid()  # the process the handlers are for (a forked child is not it)
        self.wakeup: int | None = None  # the read end of signal.set_wakeup_fd's pipe (None: not set)
        self.arrived, self.arrived_at = 0, 0.0  # a stop signal seen by the watch (its handler may not run)

    def install(self, signals: tuple[str, ...], grace: float, rank: int) -> None:
        self.grace, self.rank, self.pid = grace, rank, os.getpid()
        if threading.current_thread() is threading.main_thread():  # handlers: main thread only
            for name in signals:
                signum = getattr(signal, name)
                if signum not in self.handlers:
                    self.handlers[signum] = signal.signal(signum, self._on_signal)
            self._set_wakeup()
        # the launcher watch: only under torchrun (a launcher to outlive); a thread in every
        # process would also make fork() (multiprocessing pools) unsafe there. Elsewhere it
        # starts with the first signal, to keep the preempt_grace_s bound.
        self.under_launcher = "TORCHELASTIC_RUN_ID" in os.environ
        if self.under_launcher:
            self._start_watch()
        if self.previous_hook is None:
            self.previous_hook = sys.excepthook
            sys.excepthook = self._excepthook

    def _excepthook(self, kind: type[BaseException], err: BaseException, tb: TracebackType | None) -> None:
        """An uncaught collective timeout ends the process with its one line; others as before.
        Under a launcher the error also goes to torchrun's error file, whose last line the
        launcher's failure line carries (a script needs no `@record` for it)."""
        if isinstance(err, CollectiveTimeout) or is_timeout(err):
            supervisor = None if isinstance(err, CollectiveTimeout) else self.supervisor
            message = str(err) if supervisor is None else supervisor.describe_timeout()
            print(f"shardwise: error: {message}", file=sys.stderr, flush=True)
            tell_the_launcher(CollectiveTimeout(message))
            runlock.release_all()  # os._exit skips atexit, where the run lock goes
            os._exit(1)
        tell_the_launcher(err)
        (self.previous_hook or sys.__excepthook__)(kind, err, tb)
        if self.under_launcher and isinstance(err, CheckpointError):
            # a save every process failed alike (one agreed line): end now, as a timeout does.
            # Left to the interpreter's teardown, gloo's threads were seen to abort the process
            # (SIGABRT, "terminate called without an active exception") after the line
            sys.stdout.flush()
            sys.stderr.flush()
            runlock.release_all()  # os._exit skips atexit, where the run lock goes
            os._exit(1)

    def _set_wakeup(self) -> None:
        """Have every signal's number written to a pipe as it arrives (Python's C-level handler
        does it, whatever the main thread is doing), for the watch thread; not where another
        owner (an asyncio loop) set the wakeup fd already: theirs stays."""
        if self.wakeup is not None:
            return
        read, write = os.pipe()
        os.set_blocking(read, False)
        os.set_blocking(write, False)
        try:
            old = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        except ValueError:  # (not the main thread of the main interpreter)
            old = -2
        if old != -1:
            if old >= 0:
                signal.set_wakeup_fd(old)
            os.close(read)
            os.close(write)
            return
        self.wakeup = read
        os.register_at_fork(after_in_child=_forget_wakeup)  # (a forked child's signals are its own)

    def _read_wakeup(self, seconds: float) -> None:
        """Wait up to `seconds` for a signal's arrival; a stop signal starts the grace clock."""
        if self.wakeup is None:
            time.sleep(seconds)
            return
        ready, _, _ = select.select([self.wakeup], [], [], seconds)
        if not ready:
            return
        with contextlib.suppress(OSError):
            for signum in os.read(self.wakeup, 64):
                if signum in self.handlers and not self.arrived:
                    self.arrived, self.arrived_at = signum, time.monotonic()

    def _start_watch(self) -> None:
        if self.watch is None:
            self.watch = threading.Thread(target=self._watch_loop, name="shardwise-watch", daemon=True)
            self.watch.start()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # A process forked from this one (a DataLoader worker, a multiprocessing pool's) inherits
        # the handler but has no step boundary to save at, nor the watch thread: it takes the
        # signal's default action, as it would without shardwise (a pool's terminate() ends it).
        if os.getpid() != self.pid:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        # A repeat (the scheduler's SIGTERM and the launcher's forwarded one, or a second
        # scancel) must not cut the checkpoint short: only the first signal counts, and the
        # preempt_grace_s bound (the watch) ends a process that reaches no boundary.
        if self.preempted:
            return
        if not self.stepping:  # before the first step boundary there is no work to save
            if self.rank == 0:
                print(f"shardwise: {signal.Signals(signum).name} before the first step: nothing to save; "
                      "exiting", file=sys.stderr, flush=True)
            runlock.release_all()  # os._exit skips atexit, where the run lock goes
            os._exit(128 + signum)
        self.preempted, self.since = signum, time.monotonic()
        self._start_watch()

    def _watch_loop(self) -> None:
        while True:
            self._read_wakeup(0.2 if self.preempted or self.arrived else 1.0)
            if self.under_launcher and not self.launcher_gone and os.getppid() != self.parent:
                self.launcher_gone, self.since = True, time.monotonic()
                log.warning("rank %d: the launcher (pid %d) is gone; stopping at the next step boundary",
                            self.rank, self.parent)
            # a signal whose handler has not run (the main thread waits in a collective) counts
            # from its arrival; once the handler ran, from then (a boundary restarts the clock)
            since = self.since if self.preempted or self.launcher_gone else self.arrived_at
            waiting = (self.preempted or self.launcher_gone or self.arrived) and not self.at_boundary
            if waiting and time.monotonic() - since > self.grace:
                code = 128 + (self.preempted or self.arrived or signal.SIGTERM)
                print(f"shardwise: rank {self.rank}: no step boundary within preempt_grace_s={self.grace:g} "
                      f"s of {self.why()}; exiting ({code}) without a checkpoint",
                      file=sys.stderr, flush=True)
                runlock.release_all()  # os._exit skips atexit, where the run lock goes
                os._exit(code)

    def why(self) -> str:
        signum = self.preempted or self.arrived
        return signal.Signals(signum).name if signum else "the launcher's exit"


def _forget_wakeup() -> None:
    """In a forked child: its signals are not written to the parent's pipe."""
    with contextlib.suppress(ValueError, OSError):
        signal.set_wakeup_fd(-1)
    PROCESS.wakeup, PROCESS.arrived = None, 0


PROCESS = _Process()


@dataclass(frozen=True, slots=True)
class BoundaryDecision:
    """What every process does at an optimizer step's boundary, from the flags they agreed on."""

    save: str | None = None
    """why a checkpoint is written now (None: none by policy)"""
    stop: str | None = None
    """why the run stops here, after saving this step unless it is saved already (None: go on)"""
    failed: bool = False
    """a background checkpoint write failed on some process: every process raises"""


def decide(step: int, *, stop: bool, gone: bool, due: bool, failed: bool, every: int | None,
           signalled: str) -> BoundaryDecision:
    """The boundary's decision (pure): a failed background write is raised unless the run stops
    anyway; a stop (a signal, the launcher gone) saves and exits; else the policy's checkpoint
    (every `every` steps, or `due` by the clock)."""
    if stop or gone:
        return BoundaryDecision(stop=signalled if stop else "the launcher is gone")
    if failed:
        return BoundaryDecision(failed=True)
    if (every and step > 0 and step % every == 0) or due:
        return BoundaryDecision(save="every seconds" if due else "every step")
    return BoundaryDecision()


class Supervisor:
    """The step heartbeat, the boundary agreement and timeout reports of one Engine. It decides;
    the engine acts on the decision through its checkpoint manager."""

    def __init__(self, section: SupervisionConfig, policy: CheckpointConfig, info: DistInfo) -> None:
        self.section, self.policy, self.info = section, policy, info
        self.last_save = time.monotonic()  # the clock of checkpoint_every_seconds
        self.step_in_progress = 0
        self._progress = 0  # heartbeats sent: every process sends the same sequence
        self._pending: tuple[torch.Tensor, int, Any] | None = None  # the agreement in flight
        self._saved_at = -1  # the step of the last checkpoint by policy
        PROCESS.install(section.preempt_signals, section.preempt_grace_s, info.rank)
        PROCESS.supervisor = self
        watch = section.hang_watch if section.hang_watch is not None else info.device.type == "cuda"
        self.hang = (HangWatch(section.collective_timeout_s, info.device, self.describe_timeout, _end_stuck)
                     if watch else None)
        self._store: Any = None
        with contextlib.suppress(Exception):  # a store the heartbeats can use (absent: no names)
            from ..distributed.internals import default_store

            self._store = default_store()

    # -- the boundary -----------------------------------------------------------------------
    def at_boundary(self, step: int, *, write_failed: bool) -> BoundaryDecision:
        """After optimizer step `step`: heartbeat, then every process's decision (`decide`) from
        the flags all of them raised by the previous boundary. `write_failed`: this process's
        background write failed.

        Communication: the agreement is one all-reduce (MAX) of four flags, issued here without
        waiting and read at the next boundary: the training's own collectives never wait behind
        it, and every process reads the same flags at the same boundary. So a signal, the
        clock's checkpoint or a failed background write takes effect at the second boundary
        after it happened (one step later than a waiting agreement would)."""
        self.step_in_progress = step + 1
        PROCESS.stepping = True
        self.heartbeat("at the start")
        if PROCESS.preempted or PROCESS.launcher_gone:
            PROCESS.since = time.monotonic()  # alive: preempt_grace_s counts again, to the stop's boundary
        mine = torch.tensor([float(bool(PROCESS.preempted)), float(PROCESS.launcher_gone),
                             float(self._time_due()), float(write_failed)],
                            device=host_device(self.info.device))  # (a pure-NCCL group: the GPU)
        if self.info.world_size > 1:
            flags, issued = self._agreed(mine, step)
        else:
            flags, issued = mine, step  # a world of one agrees with itself at once
        stop, gone, due, failed = (bool(x) for x in flags.tolist())
        due = due and issued > self._saved_at  # a due raised before the last policy save is stale
        signalled = PROCESS.why() if PROCESS.preempted else "a signal to another process"
        return decide(step, stop=stop, gone=gone, due=due, failed=failed, every=self.policy.every_steps,
                      signalled=signalled)

    def _agreed(self, mine: torch.Tensor, step: int) -> tuple[torch.Tensor, int]:
        """The flags every process issued at the previous boundary (and that boundary's step;
        none at the first), after issuing this process's `mine` for the next one."""
        flags, issued = torch.zeros(4), -1
        if self._pending is not None:
            flags, issued = self.settle()
        with self.timeouts():
            work = dist.all_reduce(mine, op=dist.ReduceOp.MAX, async_op=True)
        self._pending = (mine, step, work)
        return flags, issued

    def close(self) -> None:
        """The run ends: the hang watch stops (a script's own work after it is not watched)."""
        if self.hang is not None:
            self.hang.close()

    def settle(self) -> tuple[torch.Tensor, int]:
        """Wait for the agreement in flight (before the process group goes); its flags and step."""
        if self._pending is None:
            return torch.zeros(4), -1
        flags, issued, work = self._pending
        self._pending = None
        with self.timeouts():
            work.wait()
        return flags, issued

    def saved_by_policy(self, step: int) -> None:
        """A checkpoint by policy was written at `step`: checkpoint_every_seconds counts from now."""
        self.last_save = time.monotonic()
        self._saved_at = step

    def stopping(self) -> None:
        """The stop's checkpoint is being written: the grace watch waits for it."""
        PROCESS.at_boundary = True

    def leave(self, step: int, reason: str, seconds: float, path: str) -> None:
        """The stop's checkpoint is in place: record and say it, then exit `PREEMPTED_EXIT`."""
        if self.info.is_local_main:
            run_record.append(step, seconds, path=path, stop=reason)
        say(self.info, f"stopped after step {step} ({reason}) with its checkpoint saved in "
                       f"{seconds:.2f} s; exit code {PREEMPTED_EXIT}")
        sys.stdout.flush()
        sys.stderr.flush()
        runlock.release_all()  # os._exit skips atexit, where the run lock goes
        os._exit(PREEMPTED_EXIT)

    def _time_due(self) -> bool:
        every = self.policy.every_seconds
        return bool(every) and self.info.is_main and time.monotonic() - self.last_save >= float(every or 0)

    def heartbeat(self, where: str) -> None:
        """Record this process's progress (`where` in the step in progress) in the store."""
        self._progress += 1
        if self.hang is not None:
            self.hang.beat()
        if self._store is not None:
            with contextlib.suppress(Exception):
                self._store.set(f"shardwise/progress/{self.info.rank}",
                                f"{self._progress}|{self.step_in_progress}|{where}")

    # -- timeouts -----------------------------------------------------------------------------
    @contextlib.contextmanager
    def timeouts(self) -> Iterator[None]:
        """Inside: a collective's timeout comes out as one `CollectiveTimeout` line."""
        try:
            yield
        except RuntimeError as err:
            if isinstance(err, CollectiveTimeout) or not is_timeout(err):
                raise
            raise CollectiveTimeout(self.describe_timeout()) from None

    def describe_timeout(self) -> str:
        behind = self._behind()
        who = f"; {behind} did not arrive" if behind else ""
        return (f"rank {self.info.rank}: step {self.step_in_progress}: a collective did not complete within "
                f"collective_timeout_s={self.section.collective_timeout_s:g} s{who}. The run stops; restart "
                "it (shardwise launch --max-restarts N) to resume from the newest checkpoint, unless the "
                "processes were making different calls (a generate or a collective on some processes only, "
                "or with other lengths): a restart would stop there again")

    def _seen(self, rank: int) -> tuple[int, str, str] | None:
        """Another process's newest heartbeat (count, step, where), None when it sent none."""
        key = f"shardwise/progress/{rank}"
        if not self._store.check([key]):
            return None
        count, step, where = self._store.get(key).decode().split("|", 2)
        return int(count), step, where

    def _behind(self) -> str:
        """The processes whose progress is behind this one's (read from the store)."""
        if self._store is None:
            return ""
        late = []
        with contextlib.suppress(Exception):
            self._store.set_timeout(datetime.timedelta(seconds=2))
            for r in range(self.info.world_size):
                seen = self._seen(r)
                if seen is None:
                    late.append(f"rank {r} (no step yet)")
                elif seen[0] < self._progress:
                    late.append(f"rank {r} (last seen in step {seen[1]}, {seen[2]})")
        return ", ".join(late)

    def others_moved_on(self) -> bool:
        """Every other process has sent more heartbeats than this one: they went past the point
        where this process is (every process sends the same sequence), so a call this process
        makes now, they are not making (`accelerate.hooks`: a save or forward on one process)."""
        if self._store is None:
            return False
        with contextlib.suppress(Exception):
            for r in range(self.info.world_size):
                seen = self._seen(r) if r != self.info.rank else None
                if r != self.info.rank and (seen is None or seen[0] <= self._progress):
                    return False
            return True
        return False
