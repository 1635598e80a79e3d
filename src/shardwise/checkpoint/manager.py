"""`CheckpointManager`: one engine's checkpoints, owned in one place.

It holds what a checkpoint needs besides the tensors: the folder naming (`step_<N>` with
`latest` and keep_last, or Accelerate's `checkpoint_<i>` with total_limit: `naming`), the run
lock (one run per checkpoint folder: `runlock`), this engine's background writer
(`checkpoint_async`: `background.BackgroundWriter`, with a gloo group of its own made at the
first asynchronous save), the newest save (for a stop that must not save the same step twice),
the launcher's run record, and which checkpoint a resume starts from (the `resume` setting).
The writing and reading themselves are `sharded.save` / `sharded.load`.

Verbs: `save(parts, step)`, `load(parts, folder=None)`, `wait()`, `close()`; `after(fn)` runs
`fn` once the save in flight is in place (pruning keeps the old checkpoints until then).

Threads: with `checkpoint_async` the "placed" step (the newest save noted, the run record,
`latest`, pruning) runs in the writer thread; the newest save is guarded by `_lock`, and the
main thread reads it only after `wait()`.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..config.tree import CheckpointConfig
from . import run_record, runlock, sharded
from .background import BackgroundWriter
from .naming import NumberedFolders, StepFolders
from .storage import CheckpointError, agree, os_error_line

Say = Callable[[str], None]


class CheckpointManager:
    """Saves, loads and keeps this engine's checkpoints (see the module docstring)."""

    def __init__(self, section: CheckpointConfig, *, rank: int, local_main: bool, say: Say,
                 make_group: Callable[[], dist.ProcessGroup], device: torch.device | None = None) -> None:
        self.section = section
        self.rank, self.local_main = rank, local_main
        self.root = Path(section.dir)
        self.naming: StepFolders | NumberedFolders = StepFolders(self.root, section.keep_last)
        self.writer = BackgroundWriter(device)  # (its thread set to the training's device)
        self.last_report: sharded.SaveReport | None = None  # the newest save's (pending while written)
        self._say = say
        self._make_group = make_group
        self._group: dist.ProcessGroup | None = None  # the writer's collectives (made at its first save)
        self._lock = threading.Lock()  # guards `_saved` (set in the writer thread)
        self._saved: tuple[int, str] = (-1, "")  # (step, folder) of the newest save into `root`

    # -- naming -------------------------------------------------------------------------------
    def number_like_accelerate(self, project: Any) -> NumberedFolders:
        """Accelerate's automatic naming from now on (`checkpoint_<i>` under the project)."""
        self.naming = NumberedFolders(project)
        return self.naming

    def has_saved(self, step: int) -> bool:
        """A checkpoint of `step` is in the run's folder (this run's, or a resumed run's last)."""
        with self._lock:
            if self._saved[0] == step:
                return True
        return isinstance(self.naming, StepFolders) and self.naming.has(step)

    @property
    def newest_saved(self) -> tuple[int, str]:
        """(step, folder) of this run's newest save into its folder; (-1, "") before any."""
        with self._lock:
            return self._saved

    # -- save ---------------------------------------------------------------------------------
    def save(self, parts: sharded.Parts, step: int, folder: Path | None = None, *,
             keep_last: int | None = None) -> sharded.SaveReport:
        """Checkpoint `parts` at optimizer step `step` (a collective) into `folder`, or the
        naming's next folder (then `latest` and pruning follow once it is in place)."""
        root_owned = folder is None
        target = Path(folder) if folder is not None else self._next_folder(step)
        runlock.hold_for(self.naming.root, target, self.rank, self.section.lock_lease_s)  # before anything

        def placed(report: sharded.SaveReport, group: Any) -> None:  # every process (async: writer thread)
            self._note(report, step)
            problem = None
            if root_owned and self.rank == 0 and isinstance(self.naming, StepFolders):
                try:
                    self.naming.placed(target, keep_last)
                except OSError as err:
                    problem = os_error_line(target.parent / "latest", "point at the new checkpoint", err)
            agree(problem, group)

        group = self._background_group if self.section.background else None
        # (a save in flight completes first, inside: its wait counts in this save's stall)
        self.last_report = sharded.save(parts, target, writer=self.writer, group=group, then=placed)
        return self.last_report

    def _next_folder(self, step: int) -> Path:
        if isinstance(self.naming, StepFolders):
            return self.naming.folder(step)
        return self.naming.folder(self.naming.next_index())

    def _background_group(self) -> dist.ProcessGroup:
        if self._group is None:
            self._group = self._make_group()
        return self._group

    def _note(self, report: sharded.SaveReport, step: int) -> None:
        """A checkpoint of `step` is in place: the newest save, and the launcher's run record."""
        path = Path(report.path)
        if path.parent.resolve() != self.naming.root.resolve():  # a folder the user named elsewhere
            return
        with self._lock:
            self._saved = (step, str(path))
        if self.local_main:  # one writer per machine
            run_record.append(step, report.seconds, path=str(path))

    def after(self, fn: Callable[[], None]) -> None:
        """Run `fn` (no collectives) once the save in flight is in place; now when none is."""
        self.writer.after(fn)

    # -- load ---------------------------------------------------------------------------------
    def load(self, parts: Callable[[], sharded.Parts],
             folder: str | os.PathLike[str] | None = None) -> tuple[dict[str, Any], Path] | None:
        """Load a checkpoint into `parts()` (a collective): `folder`, "latest", or (None) the one
        the `resume` setting finds in the run's folder. Returns the loop state to restore and
        the folder, or None when there is nothing to resume from (said in one line)."""
        self.writer.wait()  # a save still being written completes first (it may be this folder)
        if folder is None:
            runlock.hold(self.naming.root, self.rank, self.section.lock_lease_s)  # one run per folder
            found = self.resume_point()
            if found is None:
                return None
            path = found
        else:
            path = Path(folder)
            if str(folder) == "latest":
                path = self.root / "latest"
            path = sharded.resolve(path)
            runlock.hold_for(self.naming.root, path, self.rank, self.section.lock_lease_s)
        return sharded.load(parts(), path), path

    def resume_point(self) -> Path | None:
        """The checkpoint `load()` with no folder resumes from (the `resume` setting), or None
        for a start at step 0, said in one line; an error when there must be one."""
        root = self.naming.root
        if self.section.resume == "never":
            self._say(f"resume: never: no checkpoint loaded (checkpoint_dir {root}/); starting at step 0")
            return None
        found = self.naming.newest()
        if found is not None:
            return found
        if self.section.resume == "required":
            raise CheckpointError(f"no checkpoint under {root}/ and resume: required: check checkpoint_dir "
                                  "(or set resume: auto to start at step 0)")
        now = run_record.attempt()
        earlier = [r for r in run_record.this_run() if r.get("attempt", 0) < now and r.get("path")]
        if earlier:
            raise CheckpointError(
                f"restart {now}: an earlier attempt saved {earlier[-1]['path']} "
                f"(step {earlier[-1]['step']}), but there is no checkpoint under {root}/ now; this attempt "
                "will not start again from step 0: "
                "give every machine the same checkpoint_dir on a shared file system")
        self._say(f"no checkpoint under {root}/: starting at step 0")
        return None

    # -- waiting and the end ----------------------------------------------------------------
    def wait(self) -> float:
        """Block until the save in flight (checkpoint_async) is in place; raise its failure
        (agreed on every process) as a CheckpointError. The seconds waited."""
        return self.writer.wait()

    @property
    def failed(self) -> bool:
        """A background write ended with an error not raised yet (never blocks)."""
        return self.writer.failed

    def staging_bytes(self) -> int:
        """Host bytes held for staging checkpoints (`BackgroundWriter.held_bytes`)."""
        return self.writer.held_bytes()

    def close(self) -> None:
        """The save in flight completes (its failure raised); then the writer's group goes."""
        try:
            self.wait()
        finally:
            if self._group is not None and dist.is_initialized():
                dist.destroy_process_group(self._group)
            self._group = None
