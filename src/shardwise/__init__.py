"""shardwise: train PyTorch models that do not fit on one device, from an ordinary loop."""

from .config import ConfigError, EngineConfig, LossScaleConfig
from .engine import Accelerator, Engine, set_seed
from .memory import MemoryReport, tensor_memory

__version__ = "0.1.0"

__all__ = [
    "Accelerator",
    "ConfigError",
    "Engine",
    "EngineConfig",
    "LossScaleConfig",
    "MemoryReport",
    "__version__",
    "set_seed",
    "tensor_memory",
]
