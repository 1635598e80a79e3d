"""The step boundary: the one place the engine does its work between two optimizer steps.

It is reached once per optimizer step, before the next step's work (the prepared DataLoader's
next batch, the next `accumulate()`, or, in a loop with neither, the next forward of a prepared
model), on every process, so what happens there may communicate and a checkpoint there resumes
exactly. Its hooks run in a fixed order, each once per step (`StepBoundary.reach` is the one
idempotency check):
  observation   the metrics record when one is due, the progress bar (`runtime.observe`);
  supervision   the heartbeat and the agreement on stopping or saving (`runtime.supervision`),
                acted on here through the checkpoint manager (`act`);
  compile watch recompilations and the start-up line (`strategies.compile`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ..checkpoint.manager import CheckpointManager
from ..checkpoint.storage import CheckpointError
from ..distributed.world import DistInfo
from ..runtime.supervision import BoundaryDecision, Supervisor, say

Hook = Callable[[int], None]


class StepBoundary:
    """Ordered hooks, each called once per optimizer step."""

    def __init__(self) -> None:
        self.hooks: list[tuple[str, Hook]] = []
        self.last = -1  # the step whose boundary was reached last

    def add(self, name: str, hook: Hook) -> None:
        self.hooks.append((name, hook))

    def reach(self, step: int) -> bool:
        """Run every hook for `step` unless its boundary was reached already; True when they ran."""
        if step == self.last:
            return False
        self.last = step
        for _, hook in self.hooks:
            hook(step)
        return True

    def passed(self, step: int) -> None:
        """`step`'s boundary needs no work (a checkpoint of it was just loaded)."""
        self.last = step


def act(decision: BoundaryDecision, step: int, *, checkpoints: CheckpointManager, supervisor: Supervisor,
        save: Callable[[str], None], info: DistInfo) -> None:
    """What every process does with the boundary's decision (they all have the same one)."""
    if decision.failed:  # a background write failed (checkpoint_async) on some process: all raise
        checkpoints.wait()  # (its line: the failure is agreed over the writer's group)
        raise CheckpointError("a checkpoint written in the background failed on another process; see its "
                              "error")
    if decision.stop is not None:
        stop(step, decision.stop, checkpoints=checkpoints, supervisor=supervisor, save=save, info=info)
    if decision.save is not None:
        save(decision.save)
        supervisor.saved_by_policy(step)


def stop(step: int, reason: str, *, checkpoints: CheckpointManager, supervisor: Supervisor,
         save: Callable[[str], None], info: DistInfo) -> None:
    """Every process saves `step` (unless it is saved already), waits until the checkpoint is
    complete, and exits `PREEMPTED_EXIT` (`Supervisor.leave`)."""
    supervisor.stopping()
    t0 = time.monotonic()
    try:  # a save still being written completes first: it may be of this very step
        checkpoints.wait()
    except CheckpointError as err:  # said, and this step is saved anew below
        say(info, f"the checkpoint being written failed: {err}")
    if not checkpoints.has_saved(step):  # by policy, by the script, or the checkpoint it resumed from
        save(reason)
        checkpoints.wait()  # checkpoint_async: the process exits only once it is complete
    supervisor.leave(step, reason, time.monotonic() - t0, checkpoints.newest_saved[1])
