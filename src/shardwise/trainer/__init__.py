"""transformers' `Trainer` and TRL's trainers on shardwise (docs/trainer.md): `install()` (what
`shardwise launch` does for a script that imports the Trainer), `TrainerMixin`, `ShardwiseTrainer`."""

from __future__ import annotations

from typing import Any

from .accelerator import TrainerAccelerator as TrainerAccelerator
from .routes import (
    TrainerMixin as TrainerMixin,
    install as install,
    installed as installed,
    uninstall as uninstall,
)


def __getattr__(name: str) -> Any:
    if name == "ShardwiseTrainer":  # built on transformers.Trainer: imported only when asked for
        from transformers import Trainer

        return type("ShardwiseTrainer", (TrainerMixin, Trainer), {"__module__": __name__})
    raise AttributeError(name)
