"""Putting the Trainer on shardwise: the mixin (`TrainerMixin`, `ShardwiseTrainer`) and
`install()`, which gives `transformers.Trainer` itself, and so every class built on it (TRL's
trainers among them), the methods of `shardwise.trainer.methods`.

The two routes:
- `shardwise launch --config cfg.yaml train.py`: the workers run the script through
  `python -m shardwise.trainer.run` (`shardwise.cli.launch`), which calls `install()` when the
  script imports `transformers.trainer` (an import hook: a script without transformers pays
  nothing) and says so in the run's first lines; nothing in the script changes.
- in code (a notebook, a script run by torchrun): `shardwise.trainer.install(**config)` once,
  before the Trainer is built, or a class: `class MyTrainer(TrainerMixin, SFTTrainer)`.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

from ..config.tree import ConfigError
from . import methods
from .accelerator import TrainerAccelerator

_ORIGINALS: dict[str, Any] = {}  # transformers.Trainer's own, while installed


def _patched(name: str, original: Any) -> Any:
    replacement = methods.REPLACED[name]

    @functools.wraps(original)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        return replacement(self, functools.partial(original, self), *args, **kwargs)

    method.__shardwise__ = True  # type: ignore[attr-defined]
    return method


def install(**config: Any) -> None:
    """From now on every `transformers.Trainer` in this process (and every subclass: TRL's
    `SFTTrainer`, `DPOTrainer`, ...) builds shardwise's Accelerator and keeps its checkpoints
    sharded. `config`: EngineConfig's keywords for a run with no config file (`strategy="zero3"`,
    ...); under `shardwise launch --config` the file's settings come first. Idempotent."""
    from transformers import Trainer

    TrainerAccelerator.engine_settings = dict(config)
    for name in methods.REPLACED:
        current = getattr(Trainer, name)
        if getattr(current, "__shardwise__", False):
            continue
        _ORIGINALS[name] = current
        setattr(Trainer, name, _patched(name, current))


def on_trainer_import(module: ModuleType) -> None:
    """`shardwise launch`'s workers (`shardwise.trainer.run`): transformers.trainer was imported."""
    install()


def on_accelerate_import(module: ModuleType) -> None:
    """`shardwise launch`'s workers: a script's own `accelerate.Accelerator` would run Accelerate's
    plain engine and ignore the config: refused at construction, in one line (the Trainer's,
    built as `TrainerAccelerator`, is not that class)."""
    cls = module.Accelerator

    def refuse(self: Any, *args: Any, **kwargs: Any) -> None:
        raise ConfigError(
            "this script builds accelerate.Accelerator, which ignores the shardwise config it was launched "
            "with: change `from accelerate import Accelerator` to `from shardwise import Accelerator` (same "
            "keywords and methods), or launch it with `accelerate launch`")

    refuse.__wrapped__ = cls.__init__  # type: ignore[attr-defined]
    cls.__init__ = refuse


def end_open() -> None:
    """The launch route, after the script returned: each Trainer's Accelerator that the script
    did not end (`trainer.end()`, which most Trainer scripts never call) ends its run, every
    process alike: the last checkpoint complete, the trackers closed, the process group left with
    a last barrier. (Left to the interpreter's teardown, gloo's threads can abort a finished run
    with SIGABRT: `distributed.world.leave_process_groups`.)"""
    import torch.distributed as dist

    built = TrainerAccelerator.built
    while built:
        acc = built.pop(0)
        if not acc.ended and dist.is_initialized():
            acc.end_training()


def uninstall() -> None:
    """transformers.Trainer's own methods back (tests; a notebook switching back)."""
    from transformers import Trainer

    for name, original in _ORIGINALS.items():
        setattr(Trainer, name, original)
    _ORIGINALS.clear()
    TrainerAccelerator.engine_settings = {}


def installed() -> bool:
    return bool(_ORIGINALS)


class TrainerMixin:
    """Put first in a Trainer class's bases: `class MyTrainer(TrainerMixin, SFTTrainer)`; the
    trainer then runs on shardwise's Accelerator with sharded checkpoints (as `install()` does for
    every Trainer). Its methods are those of `methods.REPLACED`, each calling the next class's."""


def _mixin_method(name: str) -> Any:
    replacement = methods.REPLACED[name]

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        return replacement(self, getattr(super(TrainerMixin, self), name), *args, **kwargs)

    method.__name__ = method.__qualname__ = name
    return method


for _name in methods.REPLACED:  # the Trainer's hooks by name: transformers' private methods among them
    setattr(TrainerMixin, _name, _mixin_method(_name))
