"""`LoopRules`: where a training loop's rules differ between `Engine` and Accelerate.

An `Engine` follows `LoopRules()` (its own rules); `Accelerator` hands its engine the rules
`accelerate.rules.accelerate_rules` reads from Accelerate's configuration objects. Each field
names one difference of the table in docs/api.md; the engine branches on these fields only,
never on which class it runs under. (Accelerate's checkpoint naming, tracker folders and calls
made on one process alone are the `Accelerator`'s own, on top of the engine's public methods.)
"""

from __future__ import annotations

from dataclasses import dataclass

TAILS = ("split", "full", "uneven")  # how a DataLoader's last incomplete global batch is split


@dataclass(frozen=True, slots=True)
class LoopRules:
    """The rules an engine's loop follows; the defaults are the Engine's."""

    tail: str = "split"
    """The last incomplete global batch: "split" in W slices of ceil(L/W) (Engine), "full": a
    full batch per process, repeating samples (Accelerate's even_batches=True), "uneven": as is
    (even_batches=False)."""
    split_batches: bool = False
    """The DataLoader's batch is the global batch, split across processes (Accelerate's
    split_batches); otherwise it is each process's batch."""
    seedable_sampler: bool = False
    """A RandomSampler draws `randperm(n, data_seed + epoch)` (Accelerate's use_seedable_sampler)."""
    data_seed: int | None = None
    """The seed of a seedable sampler (None: the engine's seed)."""
    resume_draws: bool = False
    """A resumed pass draws its iterator seed again, as Accelerate's does (the Engine's does
    not: bit-exact with the uninterrupted run)."""
    restore_outer_loader: bool = False
    """When a loop over a loader ends, the loader active before it is active again (Accelerate's
    gradient_state); the Engine's loader stays "at end"."""
    sync_each_batch: bool = False
    """Every micro-step's backward communicates its gradients (GradientAccumulationPlugin's
    sync_each_batch); the optimizers still step at the accumulation boundary only."""
    restore_loader_position: bool = True
    """`load_state` restores where each DataLoader stood in its epoch (Accelerate: only with
    use_stateful_dataloader; its scripts skip the seen batches themselves)."""
    loaders_in_checkpoint: bool = True
    """A checkpoint holds each prepared DataLoader's state (its pass, epoch, place). False: the
    loop owns its data position (transformers' Trainer: it skips the seen batches and sets each
    pass's epoch itself, and prepares a new evaluation loader at every evaluation, so the count of
    prepared loaders is no property of the run)."""
    scheduler_steps_per_process: bool = False
    """An LR scheduler steps once per process per optimizer step (once with split_batches), as
    Accelerate's; the Engine's steps once per optimizer step."""
    step_scheduler_with_optimizer: bool = True
    """The scheduler steps only when its optimizers do (Accelerate's step_scheduler_with_optimizer;
    False: every call steps)."""

    def __post_init__(self) -> None:
        if self.tail not in TAILS:
            raise ValueError(f"LoopRules(tail={self.tail!r}): choose one of {', '.join(TAILS)}")

    def scheduler_steps_per_call(self, world: int) -> int:
        """How many times a prepared scheduler steps per `scheduler.step()` at `world` processes."""
        if not self.scheduler_steps_per_process or self.split_batches:
            return 1
        return world
