"""The optimizer step: who does what, in which order. The one place this is written down.

A step of the user's loop is: forward, `engine.backward(loss)` (micro-steps inside
`with engine.accumulate(model):`), optionally `engine.clip_grad_norm_(...)`,
`optimizer.step()`, `scheduler.step()`, `optimizer.zero_grad()`. One `StepState`, created by
the engine's `Session`, is shared by every optimizer and scheduler prepared on it:

  accumulate()      `begin_micro_step`: micro_step += 1; the micro-step ends an accumulation
                    (`sync`) every grad_accum_steps micro-steps or at the last batch of the
                    loader; off it the strategy's `no_sync` keeps gradients local; `clipped`
                    is reset.
  backward(loss)    loss / grad_accum_steps, times the precision's loss scale (fp16), then the
                    strategy's backward (DeepSpeed: its hooked backward and loss scaler).
                    `num_items=n` (a summed loss): n is added to this process's count.
  clip_grad_norm_   on the boundary only (None off it): each optimizer's gradients are unscaled
                    once (fp16) and, with num_items, rescaled to the global item mean (one
                    all-reduce of the count per boundary, `shardwise.engine.items`); the strategy
                    clips and returns the global norm over all shards;
                    `clipped` is set, so the config's `max_grad_norm` is not applied on top.
  optimizer.step()  off the boundary: nothing. On it: `record_step` (the first optimizer to
                    step on a boundary counts one optimizer step, whichever it is), the
                    gradients are rescaled (num_items) and unscaled (fp16), as above, and
                    `Strategy.optimizer_step` clips to `max_grad_norm` unless the script
                    clipped, skips the update when the fp16
                    verdict (all-reduced) says overflow, else runs the optimizer's runner. What
                    it did comes back as a `StepResult`; nothing is read from attributes.
                    DeepSpeed clips inside its own step: a bound the script set lasts that step.
  scheduler.step()  on the boundary, unless every optimizer it drives skipped (fp16 overflow).
  zero_grad()       on the boundary: the runner drops the gradients; `clipped` is reset.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .items import ItemCount


@dataclass(slots=True)
class StepState:
    """Where the loop is: micro-step, accumulation boundary, clipping, optimizer steps taken."""

    grad_accum_steps: int
    micro_step: int = 0
    """Micro-steps since the last accumulation boundary that ended a loader's epoch."""
    sync: bool = True
    """This micro-step ends an accumulation: gradients are communicated, optimizers step."""
    clipped: bool = False
    """The script clipped this step's gradients itself (the config's bound is not applied)."""
    optimizer_steps: int = 0
    """Accumulation boundaries at which an optimizer stepped (restored by `load_state`)."""
    skipped_steps: int = 0
    """Optimizer steps skipped so far (fp16 overflow), once per boundary; checkpointed. (The one
    count: the loss scaler decides, this counts.)"""
    items: ItemCount = field(default_factory=ItemCount)
    """`backward(loss, num_items=n)`: this window's count, and the rescale at its boundary."""
    _stepped: set[int] = field(default_factory=set)  # optimizers that stepped on this boundary

    def begin_micro_step(self, loader_at_end: bool) -> None:
        """A new micro-step (`accumulate()`): decide whether it ends an accumulation."""
        self.micro_step += 1
        self.clipped = False
        self._stepped.clear()
        self.sync = self.micro_step % self.grad_accum_steps == 0 or loader_at_end
        if loader_at_end:
            self.micro_step = 0

    def set_sync(self, sync: bool) -> None:
        """A loop that counts its own accumulation (transformers' Trainer) starts a micro-step and
        says whether it ends one: the optimizers step, and gradients are communicated, iff `sync`."""
        self.clipped = False
        self._stepped.clear()
        self.sync = sync

    def record_step(self, optimizer_id: int) -> bool:
        """An optimizer steps on a boundary: the first of a boundary counts one optimizer step
        (returns True). (Without `accumulate()`, the same optimizer stepping again starts a new
        boundary.)"""
        first = not self._stepped or optimizer_id in self._stepped
        if first:
            self.optimizer_steps += 1
            self._stepped.clear()
        self._stepped.add(optimizer_id)
        return first

    def end_step(self) -> None:
        """The gradients were dropped (`zero_grad` on the boundary)."""
        self.clipped = False
        self.items.reset()

    def state_dict(self) -> dict[str, Any]:
        return {"micro_step": self.micro_step, "step": self.optimizer_steps,
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.micro_step, self.optimizer_steps = int(state["micro_step"]), int(state["step"])
        # (checkpoints before 2026-12-02 kept the count in the loss scaler's state)
        older = (state.get("scaler") or {}).get("skipped", 0)  # (None: no loss scaler)
        self.skipped_steps = int(state.get("skipped_steps", older))
        self._stepped.clear()
        self.items.reset()
