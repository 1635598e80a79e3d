"""Where a run's checkpoints go and which of them are kept: `step_<N>` folders (the engine's
default: `latest`, keep_last) or Accelerate's `checkpoint_<i>` (automatic_checkpoint_naming:
the numbering, total_limit). Pure file-system logic: no collectives, no process group."""

from __future__ import annotations

import json
import re
import shutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from .files import META, OURS, mark_latest, newest, step_dirs
from .storage import is_checkpoint


class Project(Protocol):
    """Accelerate's ProjectConfiguration, as far as the numbering reads and moves it."""

    project_dir: str | None
    iteration: int
    total_limit: int | None


@dataclass
class StepFolders:
    """`<root>/step_<N>`; once one is in place, `latest` names it and only the newest
    `keep_last` step folders stay."""

    root: Path
    keep_last: int | None

    def folder(self, step: int) -> Path:
        return self.root / f"step_{step}"

    def placed(self, target: Path, keep_last: int | None) -> None:
        """Process 0, once `target` is complete: `latest`, then pruning."""
        mark_latest(target.parent, target, keep_last if keep_last is not None else self.keep_last)

    def newest(self) -> Path | None:
        return newest(self.root)

    def has(self, step: int) -> bool:
        return any(p.name == f"step_{step}" for p in step_dirs(self.root))


def checkpoint_index(path: Path) -> int:
    return int(path.name.split("_")[1])


def numbered_checkpoints(root: Path) -> list[Path]:
    """`checkpoint_<i>` folders under `root`, by number."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := re.fullmatch(r"checkpoint_(\d+)", p.name))]
    return [p for _, p in sorted(found)]


def prune_checkpoints(old: list[Path]) -> None:
    """total_limit: remove these checkpoints (this run's) unless a user put a file in one."""
    for folder in old:
        if is_checkpoint(folder, *OURS):
            shutil.rmtree(folder, ignore_errors=True)
        elif folder.is_dir():
            meta = folder / META
            ours = set(json.loads(meta.read_text()).get("files", {})) if meta.is_file() else set()
            extra = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()
                           and str(p.relative_to(folder)) not in ours | {META})
            warnings.warn(f"{folder}: kept (total_limit): it holds files that are not part of its checkpoint "
                          f"({', '.join(extra[:3])}); delete it by hand when done", stacklevel=3)


@dataclass
class NumberedFolders:
    """Accelerate's automatic naming, safe for earlier runs' checkpoints: `<project_dir>/
    checkpoints/checkpoint_<i>`, `i` from the project's `iteration`; a save never goes into an
    existing `checkpoint_<i>`: a fresh run continues the numbering after the newest one there
    (where Accelerate refuses); `total_limit` removes only checkpoints this run wrote."""

    project: Project
    written: list[Path] = field(default_factory=list)  # this run's, oldest first (total_limit's)

    @property
    def root(self) -> Path:
        return Path(self.project.project_dir or ".") / "checkpoints"

    def next_index(self) -> int:
        """The number the next save takes: the project's iteration, or past the newest folder."""
        found = numbered_checkpoints(self.root)
        return max(self.project.iteration, checkpoint_index(found[-1]) + 1 if found else 0)

    def folder(self, index: int) -> Path:
        return self.root / f"checkpoint_{index}"

    def saved(self, target: Path) -> list[Path]:
        """`target` was saved: the numbering moves on; the folders total_limit now drops."""
        self.project.iteration = checkpoint_index(target) + 1
        self.written.append(target)
        limit = self.project.total_limit
        if not limit or len(self.written) <= limit:
            return []
        old, self.written = self.written[:-limit], self.written[-limit:]
        return old

    def newest(self) -> Path | None:
        """The newest `checkpoint_<i>`; the next save goes past it."""
        found = numbered_checkpoints(self.root)
        if found:
            self.project.iteration = checkpoint_index(found[-1]) + 1
        return found[-1] if found else None
