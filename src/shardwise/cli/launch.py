"""`shardwise launch` is torchrun: build its argument list (a pure function), then run it.

One node uses torchrun's standalone rendezvous. Several nodes meet through a c10d rendezvous
(torch.distributed.elastic) at main_address:main_port, hosted by node 0. Every worker gets the
one resolved config as a file path in SHARDWISE_CONFIG.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from ..config.tree import LaunchConfig
from ..runtime.supervision import PREEMPTED_EXIT, RUN_RECORD_ENV, read_run_record

CONFIG_ENV = "SHARDWISE_CONFIG"
RUNNER = "shardwise.trainer.run"  # every launched script runs through it (docs/trainer.md)


def torchrun_argv(
    launch: LaunchConfig,
    script: str,
    script_args: Sequence[str] = (),
    extra: Sequence[str] = (),
    *,
    runner: str | None = RUNNER,
) -> list[str]:
    """torchrun's arguments for `launch`; `extra` holds further torchrun flags, passed as given.
    A script runs through the `runner` module (`python -m shardwise.trainer.run SCRIPT ARGS`: the
    script as Python runs it, with transformers' Trainer put on shardwise if it imports it); None
    runs it as torchrun would (`--module` / `--no-python` launches)."""
    argv = ["--nproc-per-node", str(launch.num_processes)]
    if launch.num_nodes == 1:
        argv.append("--standalone")
    elif launch.rdzv_backend == "static":
        argv += [
            "--nnodes", str(launch.num_nodes),
            "--node-rank", str(launch.node_rank),
            "--master-addr", launch.main_address,
            "--master-port", str(launch.main_port),
        ]
    else:
        argv += [
            "--nnodes", str(launch.num_nodes),
            "--node-rank", str(launch.node_rank),
            "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"{launch.main_address}:{launch.main_port}",
            "--rdzv-id", launch.rdzv_id,
            # node 0 hosts the rendezvous store; the others only connect to it
            "--rdzv-conf", f"is_host={'true' if launch.node_rank == 0 else 'false'}",
        ]
    argv += ["--max-restarts", str(launch.max_restarts), *extra]
    argv += ["--module", runner] if runner is not None else []
    argv += [script, *script_args]
    return argv


def run_torchrun(argv: Sequence[str], config_path: str, *, stop_signal: str = "SIGTERM",
                 stop_timeout_s: float = 30, after_save: Callable[[int], int] | None = None) -> int:
    """Run torchrun's elastic agent in this process; return the script's exit code.

    The agent starts the workers. On SIGTERM, SIGINT (Ctrl-C), SIGHUP or SIGQUIT it sends the
    workers `stop_signal` (one of their preempt_signals: each checkpoints at its next step
    boundary and exits 75), waits for them up to `stop_timeout_s`, then SIGKILLs the rest
    (torchrun's shutdown). Further signals meanwhile are ignored: cutting the wait short would
    kill a save. The line it prints says what the workers saved (their run record), or that
    nothing could be saved. A failed worker's exit code comes back as it was (128 + N for signal N).
    When the workers stopped after a checkpoint (exit 75, the launcher signalled or not),
    `after_save(code)` gives the exit status instead (the SLURM requeue). A signal once the agent
    has returned changes nothing: the status is decided (`ignore_stop_signals` keeps it so through
    the interpreter's exit).
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    from ..distributed.internals import terminate_handler

    os.environ[CONFIG_ENV] = config_path
    fd, record = tempfile.mkstemp(prefix="shardwise-run-", suffix=".jsonl")
    os.close(fd)
    os.environ[RUN_RECORD_ENV] = record
    args = parse_args(list(argv))
    # newer torchruns take --shutdown-timeout (the user's value wins); older ones wait a fixed 30 s
    if getattr(args, "shutdown_timeout", 0) is None:
        args.shutdown_timeout = math.ceil(stop_timeout_s)
    stop = _Stop(signal.Signals[stop_signal])
    saved, code = False, 0
    try:
        # the agent installs this handler for every signal it stops on
        with terminate_handler(stop.handler):
            run(args)
    except ChildFailedError as err:
        stop.closed = True
        for line in describe_failures(err.failures):
            print(f"shardwise launch: {line}", file=sys.stderr, flush=True)
        code = err.get_first_failure()[1].exitcode
        code = code if code > 0 else 128 - code
        saved = all(f.exitcode == PREEMPTED_EXIT for f in err.failures.values())
    except SignalException as err:
        stop.closed = True
        first = stop.first or int(err.sigval)
        rows = read_run_record(record)
        print(f"shardwise launch: {describe_stop(first, stop.repeats, rows)}", file=sys.stderr, flush=True)
        code, saved = 128 + first, _saved_at_stop(rows)
    except KeyboardInterrupt:  # Ctrl-C before the workers started
        code = 128 + signal.SIGINT
    finally:
        stop.closed = True
        Path(record).unlink(missing_ok=True)
    return after_save(code) if saved and after_save is not None else code


def ignore_stop_signals() -> None:
    """Ignore the launcher's stop signals from now on: its exit status is decided. (Python's
    finalization puts the default action back on every signal it handled, so a repeated SIGTERM
    during the interpreter's exit would otherwise end the process by the signal, status -15,
    instead of the status it chose.)"""
    for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT"):
        with contextlib.suppress(AttributeError, ValueError, OSError):
            signal.signal(getattr(signal, name), signal.SIG_IGN)


def requeue_slurm(job: str, code: int) -> int:
    """After the workers saved and exited 75 in a SLURM job: `scontrol requeue JOB`, said in one
    line; the exit status `code` stays when it worked, else PREEMPTED_EXIT (75: a cluster with
    `RequeueExit=75` requeues on it) with a line saying why."""
    why = ""
    try:
        done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60,
                              check=False)
        said = (done.stderr or done.stdout).strip().splitlines()
        if done.returncode != 0:
            why = f"scontrol requeue {job} failed with exit code {done.returncode}" + (
                f": {said[-1]}" if said else "")
    except FileNotFoundError:
        why = "scontrol is not on PATH"
    except (OSError, subprocess.TimeoutExpired) as err:
        why = f"scontrol requeue {job}: {err}"
    if why:
        print(f"shardwise launch: SLURM job {job} not requeued: {why}; exiting {PREEMPTED_EXIT} (requeue it "
              f"with `scontrol requeue {job}`, or submit the same script again: it resumes from the "
              "checkpoint)", file=sys.stderr, flush=True)
        return PREEMPTED_EXIT
    print(f"shardwise launch: requeued SLURM job {job} (scontrol requeue {job}); it runs the same script "
          "again and resumes from the checkpoint just saved", file=sys.stderr, flush=True)
    return code


def _saved_at_stop(record: list[dict[str, Any]]) -> bool:
    stops = [r for r in record if r.get("stop")]
    return bool(stops and stops[-1].get("path"))


class _Stop:
    """The launcher's stop signals while the agent runs: the first one stops the workers, the
    rest are counted and ignored (the agent is waiting for the workers' checkpoints)."""

    def __init__(self, death: signal.Signals) -> None:
        self.death, self.first, self.repeats = death, 0, 0
        self.closed = False  # the agent has returned: the exit status is decided

    def handler(self, signum: int, frame: FrameType | None) -> None:
        from torch.distributed.elastic.multiprocessing.api import SignalException

        if self.first or self.closed:
            self.repeats += 1
            return
        self.first = signum
        raise SignalException(f"Process {os.getpid()} got signal: {signal.Signals(signum).name}",
                              sigval=self.death)


def describe_stop(signum: int, repeats: int, record: list[dict[str, Any]]) -> str:
    """The launcher's line after a stop signal: what the workers saved (the newest stop in the
    run record), or that nothing could be saved."""
    name = signal.Signals(signum).name + (f" (and {repeats} more signal(s), ignored while the workers saved)"
                                          if repeats else "")
    stops = [r for r in record if r.get("stop")]
    if not stops or not stops[-1].get("path"):
        return (f"stopped by {name}; nothing could be saved: no worker reached a step boundary within "
                "preempt_grace_s, or the save failed (see the lines above); the newest checkpoint is "
                "unchanged")
    last = stops[-1]
    return (f"stopped by {name}; the workers saved {last['path']} (step {last['step']}) in "
            f"{last['seconds']:.2f} s and exited {PREEMPTED_EXIT}; the same command resumes from step "
            f"{last['step']}")


def describe_failures(failures: dict[int, Any]) -> list[str]:
    """One line per failed worker (torchrun's ProcessFailure), the first to fail first: its
    rank, how it ended and the first line of its error."""
    lines = []
    for rank, f in sorted(failures.items(), key=lambda item: item[1].timestamp):
        code = f.exitcode
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        first = _first_error_line(f.error_file)
        if code == PREEMPTED_EXIT:
            how += " (stopped after a checkpoint: preempted, or its launcher went away)"
        elif code == -signal.SIGABRT and not first:  # an abort with no Python error: a C++ terminate
            how += (" (if that was while the process group connected, it is gloo's start-up abort; "
                    "--max-restarts 1 restarts the group by itself)")
        said = f"rank {rank} (local rank {f.local_rank}, pid {f.pid}) {how}"
        lines.append(said + (f": {first}" if first else ""))
    return lines


def _first_error_line(path: str | None) -> str:
    """The message torchrun's error file holds for a worker that raised (empty if none)."""
    try:
        with open(path or "") as fh:
            data = json.load(fh)
        message = data.get("message", {})
        text = message.get("message", "") if isinstance(message, dict) else str(message)
    except (OSError, ValueError, AttributeError):
        return ""
    lines = [ln for ln in str(text).splitlines() if ln.strip()]
    return lines[-1].strip() if lines else ""
