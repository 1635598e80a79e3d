"""Strategy name -> implementation: the one table that knows the names."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..config import EngineConfig
from ..dist import DistInfo
from .base import OptimizerRunner, Strategy
from .ddp import DDPStrategy
from .blocks import apply_activation_checkpointing, find_blocks
from .fsdp import FSDPStrategy, apply_fsdp

_Factory = Callable[[EngineConfig, DistInfo, torch.dtype], Strategy]

STRATEGIES: dict[str, _Factory] = {
    "ddp": lambda c, i, d: DDPStrategy(c, i, d, shard_optimizer=False),
    "zero1": lambda c, i, d: DDPStrategy(c, i, d, shard_optimizer=True),
    "zero2": lambda c, i, d: FSDPStrategy(c, i, d, stage=2),
    "zero3": lambda c, i, d: FSDPStrategy(c, i, d, stage=3),
}


def make_strategy(cfg: EngineConfig, info: DistInfo, param_dtype: torch.dtype) -> Strategy:
    """The strategy `cfg.strategy` names on the engine `cfg.backend` names (both validated)."""
    if cfg.backend == "deepspeed":
        from .deepspeed import DeepSpeedStrategy  # imports deepspeed itself only when built

        return DeepSpeedStrategy(cfg, info, param_dtype)
    return STRATEGIES[cfg.strategy](cfg, info, param_dtype)


__all__ = [
    "STRATEGIES",
    "OptimizerRunner",
    "Strategy",
    "apply_activation_checkpointing",
    "apply_fsdp",
    "find_blocks",
    "make_strategy",
]
