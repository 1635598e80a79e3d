"""shardwise: train PyTorch models that do not fit on one device, from an ordinary loop."""

from .accelerate.accelerator import Accelerator
from .accelerate.extras import ProfileKwargs
from .accelerate.objects import (
    DataLoaderConfiguration,
    DistributedType,
    GradientAccumulationPlugin,
    ProjectConfiguration,
)
from .config.tree import ConfigError, EngineConfig, LossScaleConfig
from .engine.engine import Engine, set_seed
from .runtime.memory import MemoryReport, tensor_memory
from .version import __version__

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
    "__version__",
    "set_seed",
    "tensor_memory",
]
