"""shardwise: train PyTorch models that do not fit on one device, from an ordinary loop."""

from .accelerate_extras import ProfileKwargs
from .accelerate_types import (
    DataLoaderConfiguration,
    DistributedType,
    GradientAccumulationPlugin,
    ProjectConfiguration,
)
from .accelerator import Accelerator
from .config import ConfigError, EngineConfig, LossScaleConfig
from .engine import Engine, set_seed
from .memory import MemoryReport, tensor_memory

__version__ = "0.1.0"

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
