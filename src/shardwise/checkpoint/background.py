"""Asynchronous checkpoints (`checkpoint_async: true`): stage to host memory, write in a thread.

`sharded.save(..., writer=...)` does on the calling thread what must see the training state at
this instant: the target checks and the staging folder, the DCP state dict (which may run
collectives, e.g. zero1's gather of its optimizer state), and a deep copy of it into fresh host
memory (`stage`), with the loop state and this process's generator states. Then it returns, and
the engine's writer thread (`BackgroundWriter`, owned by its `CheckpointManager`) writes that
copy exactly as a synchronous save would (DCP, checksums, the sums gathered, meta.json last,
the atomic exchange, then `latest`, keep_last and the run record).

Communication: the writer's collectives (DCP's plan exchange, the gather of checksums, the
agreements on errors) run on a gloo group of their own (`distributed.world.new_background_group`,
one per checkpoint manager), made on the main thread at the first asynchronous save. On the
training's group they would interleave with the collectives the main thread issues meanwhile
(gradient reduce-scatters, all-gathers), in an order that differs between processes: a
deadlock or, worse, mixed-up tensors.

Memory: the staged copy is the checkpointed state's local bytes (a sharded strategy's shards of
the weights and of the optimizer state; whole tensors where the process holds them whole), held
from the save until its write completes; `memory_report().staging` counts it. On CUDA the copy
goes to pinned buffers, kept for the next save (the same shapes each time) and counted while
they are held.

One save in flight per engine: a save first waits for the pending one (its wait counts in the
save's stall); `load_state`, `end_training`, `free_memory` and a preemption wait too. A failed
write is raised as the same CheckpointError on every process (its errors are agreed over the
writer's group) at the next wait, save or step boundary; never dropped.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ..distributed.host import pinned
from ..distributed.internals import local_tensor, with_local
from .storage import CheckpointError, one_line

__all__ = ["BackgroundWriter", "stage"]


class _Pool:
    """Pinned host buffers for staging CUDA tensors, reused across saves: the n-th tensor staged
    takes the n-th buffer when its shape and dtype match (a training's state keeps them). Each is
    exactly its bytes (`distributed.host.pinned`), as `held_bytes` counts it."""

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = []

    def take(self, n: int, like: torch.Tensor) -> torch.Tensor:
        if n < len(self.buffers):
            buf = self.buffers[n]
            if buf.shape == like.shape and buf.dtype == like.dtype:
                return buf
        buf = pinned(like.shape, like.dtype)
        if n < len(self.buffers):
            self.buffers[n] = buf
        else:
            self.buffers.append(buf)
        return buf

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)


class _Copier:
    """One deep copy of a state dict into host memory (see `stage`)."""

    def __init__(self, pool: _Pool) -> None:
        self.pool = pool
        self.copies: dict[int, torch.Tensor] = {}  # id of a source tensor -> its copy (a tensor met twice)
        self.taken = 0  # pool buffers handed out
        self.nbytes = 0
        self.cuda = False

    def tensor(self, t: torch.Tensor) -> torch.Tensor:
        if id(t) in self.copies:  # tied weights stay one tensor, as DCP saw them
            return self.copies[id(t)]
        local = local_tensor(t).detach()
        if local.device.type == "cuda":
            buf = self.pool.take(self.taken, local)
            self.taken += 1
            buf.copy_(local, non_blocking=True)  # completed by the one synchronize in `stage`
            self.cuda = True
        else:
            buf = local.clone()
        self.nbytes += buf.numel() * buf.element_size()
        out = buf
        if isinstance(t, DTensor):  # the same shard of the same global tensor, on the same mesh,
            out = with_local(buf, t)  # left on the host (from_local would copy it back to the GPU)
        self.copies[id(t)] = out
        return out

    def copy(self, obj: Any) -> Any:
        if torch.is_tensor(obj):
            return self.tensor(obj)
        if isinstance(obj, dict):
            out = copy.copy(obj)  # (its type kept: an OrderedDict stays one)
            for k, v in obj.items():
                out[k] = self.copy(v)
            return out
        if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
            return type(obj)(self.copy(v) for v in obj)
        return copy.deepcopy(obj)


def stage(state: Any, pool: _Pool | None = None) -> tuple[Any, int]:
    """A deep copy of `state` (a DCP state dict) in fresh host memory, and its tensor bytes.

    Every tensor's local data is copied (a DTensor's shard, rebuilt as a DTensor with the same
    mesh, placements, shape and stride, so DCP writes the same items), each tensor once; other
    values are deep-copied. CUDA tensors go to `pool`'s pinned buffers, one synchronize at the end.
    """
    copier = _Copier(pool if pool is not None else _Pool())
    with torch.no_grad():
        out = copier.copy(state)
    if copier.cuda:
        torch.cuda.current_stream().synchronize()  # the host copies are complete before any write
    return out, copier.nbytes


class BackgroundWriter:
    """This process's background checkpoint writer: at most one write in flight."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device  # the training's device: the writer thread works on it too
        self.thread: threading.Thread | None = None
        self.error: str | None = None  # the failed write's line, until raised on the main thread
        self.target: Path | None = None
        self.staged = 0  # bytes of the staged copy held by the write in flight
        self.pool = _Pool()  # CUDA: pinned staging buffers, kept for the next save
        self._lock = threading.Lock()  # guards `_busy` and `_after` between the two threads
        self._busy = False  # a write is in flight (set by `start`, cleared by the writer thread)
        self._after: list[Callable[[], None]] = []  # to run once the write in flight succeeded

    def start(self, target: Path, nbytes: int, job: Callable[[], None]) -> None:
        """Run `job` (the write of a staged checkpoint to `target`) in the writer thread."""
        if self.thread is not None and self.thread.is_alive():
            raise RuntimeError("a checkpoint write is already in flight; wait() for it first")
        self.target, self.staged, self._busy = target, nbytes, True
        # Not a daemon: at interpreter exit without end_training (a script that just ends, or
        # raises), Python joins it before atexit runs, so the pending checkpoint still completes
        # and the run lock (removed at atexit) is held until then. That is safe: the write's
        # collectives are on the writer's own group, and every process has the same write
        # pending, so none waits for a process that is leaving; a peer that died makes them
        # time out (collective_timeout_s) and the thread ends with the failure.
        self.thread = threading.Thread(target=self._run, args=(target, job), name="shardwise-checkpoint",
                                       daemon=False)
        self.thread.start()

    def _run(self, target: Path, job: Callable[[], None]) -> None:
        try:
            if self.device is not None and self.device.type == "cuda":
                # a thread starts on GPU 0: on another local rank, any CUDA call of the write
                # (torch's writer's streams, a stray device tensor) would run, and open a
                # context, on another process's GPU
                torch.cuda.set_device(self.device)
            job()
            with self._lock:
                after, self._after, self._busy = self._after, [], False
            for fn in after:
                fn()
        except BaseException as err:  # noqa: BLE001 -- kept, and raised on the main thread
            self.error = (str(err) if isinstance(err, CheckpointError) else one_line(
                f"{target}: the background checkpoint write failed: {type(err).__name__}: {err}"))
        finally:
            with self._lock:
                self._after, self._busy = [], False  # a failed write's followers never run
            self.staged = 0  # the job's frame, and with it the staged copy, is gone

    def after(self, fn: Callable[[], None]) -> None:
        """Run `fn` (no collectives) once the write in flight has succeeded, in the writer
        thread; at once when none is in flight. Pruning older checkpoints this way keeps them
        until the new one is complete."""
        with self._lock:
            if self._busy:
                self._after.append(fn)
                return
        fn()

    @property
    def pending(self) -> bool:
        """A write is in flight."""
        return self._busy

    @property
    def failed(self) -> bool:
        """The last write ended with an error not raised yet (never blocks)."""
        return self.error is not None and not self.pending

    def wait(self) -> float:
        """Block until the write in flight (if any) is complete; the seconds waited. Its failure
        is raised here, once, as a CheckpointError."""
        t0 = time.perf_counter()
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        waited = time.perf_counter() - t0
        error, self.error = self.error, None
        if error is not None:
            raise CheckpointError(error)
        return waited

    def held_bytes(self) -> int:
        """Host bytes of staging held now: the copy of a write in flight; on CUDA, the pinned
        buffers (kept for the next save) whenever there are any."""
        return max(self.staged if self.pending else 0, self.pool.nbytes())
