"""shardwise: train PyTorch models that do not fit on one device, from an ordinary loop."""

from typing import Any

from .accelerate.accelerator import Accelerator
from .accelerate.extras import ProfileKwargs
from .accelerate.objects import (
    DataLoaderConfiguration,
    DistributedType,
    GradientAccumulationPlugin,
    ProjectConfiguration,
)
from .config.tree import ConfigError, EngineConfig, LossScaleConfig
from .engine import engine as _engine_module
from .engine.engine import Engine, set_seed
from .runtime.memory import MemoryReport, SavedActivations, tensor_memory
from .version import __version__


def _choose(*args: Any, **kwargs: Any) -> Any:
    """strategy="auto": the planner's choice (imported at the first prepare that needs it)."""
    from .plan.auto import choose

    return choose(*args, **kwargs)


_engine_module.AUTO_CHOOSER.choose = _choose

__all__ = [
    "Accelerator",
    "ConfigError",
    "DataLoaderConfiguration",
    "DistributedType",
    "Engine",
    "EngineConfig",
    "GradientAccumulationPlugin",
    "LossScaleConfig",
    "MemoryReport",
    "ProfileKwargs",
    "ProjectConfiguration",
    "SavedActivations",
    "__version__",
    "set_seed",
    "tensor_memory",
]
