"""A small spawn helper: N CPU processes on gloo over loopback, torchrun's environment,
worker errors re-raised in the test process with their traceback."""

from __future__ import annotations

import contextlib
import faulthandler
import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import audit
import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn: Callable[..., Any], rank: int, world: int, port: int, out: str, args: tuple) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        HF_HUB_OFFLINE="1",
    )
    torch.set_num_threads(1)
    # a worker still running at the deadline writes every thread's stack here first (SIGUSR1)
    stacks = open(Path(out) / f"{rank}.stacks", "w")  # noqa: SIM115 -- open until the process ends
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    if audit.enabled():  # NCCL's rules checked at every collective (tests/audit.py)
        audit.install()
    code = 0
    try:
        result = fn(*args)
        torch.save(result, Path(out) / f"{rank}.pt")
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()  # no rank leaves while another may still be finishing a collective
        audit.write(out, rank)
    except BaseException:  # noqa: BLE001 -- every failure goes back to the test process
        (Path(out) / f"{rank}.err").write_text(traceback.format_exc())
        code = 1
    # Leave without interpreter teardown: the results are on disk, and C++ destructors of
    # process-group threads racing at exit once aborted a worker that had finished its work.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# Infrastructure flakes that have nothing to do with the code under test; such a run is retried
# once. A port picked free can be taken before rank 0 binds it. And gloo's TCP transport
# occasionally aborts a process while wiring up its connections (std::terminate, SIGABRT, no
# Python traceback) on this machine when many short runs follow each other.
_RENDEZVOUS_FLAKES = ("EADDRINUSE", "address already in use", "DistNetworkError", "-6]")
GLOO_ABORT = "terminate called without an active exception"


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (children, theirs, ...), read from /proc: torchrun starts each
    worker in a session of its own, so killing the launcher's session does not reach them."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_tree(pid: int) -> None:
    """SIGKILL `pid`'s session and every process below it (workers in sessions of their own too)."""
    below = descendants(pid)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    for child in below:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)


def wait_for_launchers(procs: list[subprocess.Popen[str]],
                       timeout: float) -> tuple[list[int | None], list[str]]:
    """Each launcher's exit code and output, all within `timeout` seconds; past it, each
    launcher (started with start_new_session=True), its session and every process below it
    (torchrun's workers run in sessions of their own) is killed and its output says so."""
    deadline = time.monotonic() + timeout
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                kill_tree(q.pid)
            outs.append(f"timed out after {timeout} s\n" + (p.communicate()[0] or ""))
    return [p.returncode for p in procs], outs


def retried(what: str, why: str) -> None:
    """Say that a run is run once more (a test's output and pytest's warnings summary name it):
    a retry hides whatever made the first run fail, so it is never silent."""
    message = f"{what}: {why}; run once more (once at most)"
    print(message, file=sys.stderr)
    warnings.warn(message, stacklevel=3)


def launch_twice_at_most(start: Callable[[], tuple[list[int | None], list[str]]], what: str,
                         wrote: Callable[[], bool]) -> tuple[list[int | None], list[str]]:
    """`start()` (launchers' codes and outputs), once more only after a gloo abort while starting:
    nothing recorded yet (`wrote()` False). An abort after a run recorded results (at teardown)
    is a failure, never retried; the retry is said (`retried`)."""
    codes, outs = start()
    if any(c != 0 for c in codes) and any(GLOO_ABORT in o for o in outs) and not wrote():
        retried(what, "gloo aborted while starting (nothing recorded yet)")
        codes, outs = start()
    return codes, outs


def run_command(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """subprocess.run(cmd, capture_output=True, text=True), run again once after a gloo abort
    (said, with the command); a second abort is returned as it is."""
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, **kwargs)
    if proc.returncode != 0 and GLOO_ABORT in proc.stderr + proc.stdout:
        retried(" ".join(str(c) for c in cmd)[:300], f"gloo aborted (exit {proc.returncode})")
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True, **kwargs)
    return proc


def spawn(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 600) -> list[Any]:
    """Run `fn(*args)` on `world` processes; return each rank's result (rank order)."""
    try:
        return _spawn_once(fn, world, args, timeout)
    except RuntimeError as err:
        flakes = [flake for flake in _RENDEZVOUS_FLAKES if flake in str(err)]
        if not flakes:
            raise
        retried(f"spawn({_name(fn)}, {world})", f"an infrastructure flake ({flakes[0]!r})")
        return _spawn_once(fn, world, args, timeout)


def _name(fn: Callable[..., Any]) -> str:
    inner = getattr(fn, "func", None)  # a functools.partial (planted(...)): the worker inside
    args = getattr(fn, "args", ())
    if inner is not None and args:
        return f"{_name(args[-1])} with fault {args[0]!r}" if callable(args[-1]) else _name(inner)
    return getattr(fn, "__qualname__", repr(fn))


# Workers start from a forkserver that has already imported torch and shardwise: a fresh
# interpreter per worker ("spawn") spent ~6 s importing them on this machine, every spawn. The
# server is single-threaded when it forks (imports start no threads); each worker then builds its
# own process group, as under spawn.
_PRELOAD = ["torch", "torch.distributed.tensor", "shardwise", "workloads"]


def _context() -> mp.context.BaseContext:
    if os.environ.get("SHARDWISE_TEST_SPAWN") == "spawn":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _spawn_once(fn: Callable[..., Any], world: int, args: tuple, timeout: float) -> list[Any]:
    ctx = _context()
    with tempfile.TemporaryDirectory() as out:
        port = free_port()
        procs = [ctx.Process(target=_entry, args=(fn, r, world, port, out, args)) for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        while any(p.is_alive() for p in procs):
            failed = [p for p in procs if p.exitcode not in (None, 0)]
            if failed or time.monotonic() > deadline:
                if not failed:  # a hang: every live worker's stacks, for the error below
                    for p in procs:
                        if p.is_alive() and p.pid is not None:
                            os.kill(p.pid, signal.SIGUSR1)
                time.sleep(2)  # let the failing rank finish writing its traceback
                for p in procs:
                    p.kill()
                break
            time.sleep(0.05)
        for p in procs:
            p.join()
        errors = sorted(Path(out).glob("*.err"))
        if errors:
            raise RuntimeError("worker failed:\n" + "\n".join(e.read_text() for e in errors))
        if any(p.exitcode != 0 for p in procs):
            codes = [p.exitcode for p in procs]
            stacks = "\n".join(f"rank {r}:\n{(Path(out) / f'{r}.stacks').read_text()}" for r in range(world)
                               if (Path(out) / f"{r}.stacks").is_file())
            raise RuntimeError(f"workers exited with {codes} (timeout {timeout}s?)\n{stacks}")
        audit.add(out)  # the collectives the auditor checked, for pytest's summary
        return [torch.load(Path(out) / f"{r}.pt", weights_only=False) for r in range(world)]
