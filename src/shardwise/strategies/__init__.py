"""The strategies: `make_strategy` builds the one a config names.

The names and what each combines with are `config.STRATEGY_TABLE`; here each ZeRO stage maps to
its implementation on each backend.
"""

from __future__ import annotations

from ..config.tree import STRATEGY_TABLE, EngineConfig
from ..distributed.world import DistInfo
from .base import OptimizerRunner, StepResult, Strategy
from .blocks import apply_activation_checkpointing, find_blocks
from .ddp import DDPStrategy
from .fsdp import FSDPStrategy, apply_fsdp


def make_strategy(cfg: EngineConfig, info: DistInfo) -> Strategy:
    """The strategy `cfg.sharding.strategy` names on its backend (`cfg.sharding.backend`; both validated)."""
    stage = STRATEGY_TABLE[cfg.sharding.strategy].stage
    if cfg.sharding.backend == "deepspeed":
        from .deepspeed.strategy import DeepSpeedStrategy  # imports deepspeed itself only when built

        return DeepSpeedStrategy(cfg, info, stage=stage)
    if stage <= 1 and cfg.parallelism.tp == 1:  # (torch's DDP takes no DTensor parameters)
        return DDPStrategy(cfg, info, shard_optimizer=stage == 1)
    return FSDPStrategy(cfg, info, stage=stage)


__all__ = [
    "OptimizerRunner",
    "StepResult",
    "Strategy",
    "apply_activation_checkpointing",
    "apply_fsdp",
    "find_blocks",
    "make_strategy",
]
