"""`TrainerAccelerator`: shardwise's `Accelerator` with the members transformers' `Trainer` reads
beyond Accelerate's public API.

The Trainer does its own gradient accumulation: it builds its Accelerator with one micro-step
per step and sets `gradient_state._set_sync_gradients(...)` before every micro-batch (it
prefetches a step's batches, so the loader cannot say where a step ends). Here that flag is the
engine's step state (`StepState.sync`): off the boundary nothing is communicated and the prepared
optimizer does not step, as under Accelerate. The plugins the Trainer builds from
`TrainingArguments.fsdp` / `deepspeed` reach `Accelerator(fsdp_plugin=..., deepspeed_plugin=...)`
and are translated there (`accelerate.plugins`); the Trainer itself sees no plugin
(`state.fsdp_plugin` / `deepspeed_plugin` are None), so it keeps its own loop and hands every
engine decision to shardwise.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from ..accelerate.accelerator import Accelerator
from ..accelerate.objects import GradientState
from ..engine.loop_rules import LoopRules


class TrainerGradientState(GradientState):
    """Accelerate's `gradient_state` as the Trainer drives it."""

    def __init__(self, engine: Any) -> None:  # the Accelerator's Engine
        super().__init__(engine)
        self.plugin_kwargs: dict[str, Any] = {}  # the Trainer reads sync_each_batch here

    def _set_sync_gradients(self, sync: bool) -> None:
        """The Trainer's micro-step: True on the last micro-batch of an optimizer step."""
        self._acc.set_micro_step(sync)


class TrainerAccelerator(Accelerator):
    """The Accelerator a Trainer runs on under shardwise (`shardwise.trainer.install`, or the
    `TrainerMixin` / `ShardwiseTrainer` classes). Keywords for the engine that the Trainer does not
    pass (a notebook's config) come from `install(**config)`."""

    engine_settings: ClassVar[dict[str, Any]] = {}  # install(**config): EngineConfig's keywords

    def __init__(self, **kwargs: Any) -> None:
        for key, value in self.engine_settings.items():
            kwargs.setdefault(key, value)
        # the Trainer always passes DDP's tuning (find_unused_parameters from its own defaults, and
        # ddp_* arguments): shardwise's DDP sets its own, so that handler says nothing here
        kwargs["kwargs_handlers"] = [h for h in kwargs.get("kwargs_handlers") or []
                                     if type(h).__name__ != "DistributedDataParallelKwargs"]
        super().__init__(**kwargs)
        self.gradient_state = TrainerGradientState(self.engine)
        self.scaler = None  # fp16's loss scale is the engine's (its state is in the checkpoint)
        self.ended = False  # end_training() was called (`trainer.end()`, or the launch route's end)
        self.built.append(self)

    built: ClassVar[list[TrainerAccelerator]] = []  # `routes.end_open` takes them (the launch route)

    def end_training(self) -> None:
        """Once: `trainer.end()` in the script, else the launch route after the script."""
        if not self.ended:
            self.ended = True
            super().end_training()

    def loop_rules(self) -> LoopRules:
        """Accelerate's, with the data position the Trainer's own (`LoopRules.loaders_in_checkpoint`)."""
        return dataclasses.replace(super().loop_rules(), loaders_in_checkpoint=False)

    def backward(self, loss: Any, **kwargs: Any) -> None:
        """The Trainer scales its loss for accumulation itself (the engine accumulates over one
        micro-step), so DeepSpeed's `scale_wrt_gas=False`, which it passes on that engine, is
        what happens anyway."""
        kwargs.pop("scale_wrt_gas", None)
        super().backward(loss, **kwargs)

    @property
    def _models(self) -> list[Any]:
        """The prepared models (the Trainer prepares a model for evaluation when there is none)."""
        return self.engine.prepared_models
