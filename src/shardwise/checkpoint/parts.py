"""What a checkpoint reads from the engine and writes back into it: `Parts`, and the two owners
of tensor state it asks, as structural types.

The owners are the strategy (the models' weights in its layout: `shardwise.strategies.base.Strategy`)
and one optimizer runner per prepared optimizer (`shardwise.strategies.base.OptimizerRunner`).
They sit in a layer above this package, so the checkpoint names only what it calls on them
(`ModelStateOwner`, `OptimizerStateOwner`); any object with those members fits, which mypy checks
where the engine fills `Parts` (`shardwise.engine.loop_state.checkpoint_parts`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn


class ModelStateOwner(Protocol):
    """The models' weights as a checkpoint holds them: what the strategy gives and takes back."""

    @property
    def shard_group_size(self) -> int:
        """Processes in one sharding group (recorded in meta.json; a load reshards whatever it is)."""

    def model_state(self, model: nn.Module) -> dict[str, Any]:
        """`model`'s weights keyed by parameter name, each whole or a DTensor of its layout (DCP's
        state dict: tensors, nested where a strategy keeps more than a tensor per name)."""

    def load_model_state(self, model: nn.Module, state: dict[str, Any]) -> None:
        """Take back what `model_state` gave, filled in place by the checkpoint reader."""


class OptimizerStateOwner(Protocol):
    """One prepared optimizer's state as a checkpoint holds it: what its runner gives and takes back."""

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The user's optimizer (its class is recorded, and named when a load cannot find its state)."""

    def checkpoint_state(self, model: nn.Module) -> dict[str, Any]:
        """The optimizer state of `model`'s parameters keyed by parameter name, each tensor whole
        or a DTensor of its parameter's layout, so any strategy and world size can load it."""

    def load_checkpoint_state(self, model: nn.Module, state: dict[str, Any]) -> None:
        """Take back what `checkpoint_state` gave, filled in place by the checkpoint reader."""


@dataclass
class Parts:
    """What an Engine checkpoints (the Engine fills this; nothing here reaches into it)."""

    models: list[nn.Module]
    unwrapped: list[nn.Module]
    runners: list[OptimizerStateOwner]  # one per prepared optimizer
    optimizer_models: list[int]  # index of the model each optimizer updates
    loop_state: dict[str, Any]  # step counters, loss scaler, schedulers, loaders, registered objects
    strategy: ModelStateOwner  # the weights in the strategy's layout
    info: dict[str, str]  # backend, strategy, offload, precision
    rank: int
    world: int
