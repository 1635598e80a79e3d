"""What `Engine` keeps beside its session: the config it was given in code, the DataLoader whose
loop is under way, and the loop state a checkpoint holds besides tensors.

These are plain functions and one small class over public objects (`Session`,
`PreparedDataLoader`), so `engine/engine.py` stays the list of the user's verbs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..checkpoint.storage import CheckpointError
from ..config.files import config_with_code
from ..config.specs import check_log_with
from ..config.tree import ConfigError, EngineConfig
from ..distributed.world import config_source
from ..weights.ema import is_ema
from .data import PreparedDataLoader, is_dataloader
from .optim import PreparedOptimizer
from .session import Session

_ACCELERATE_PRECISION = {"no": "fp32", "fp32": "fp32", "bf16": "bf16", "fp16": "fp16"}


def config_from_code(config: EngineConfig | None, kwargs: dict[str, Any]) -> tuple[EngineConfig, list[str]]:
    """The config an `Engine(config=..., **kwargs)` runs with, and the values the code's keywords
    changed in the launcher's config file (to warn about). Accelerate's `mixed_precision` and
    `gradient_accumulation_steps` keywords are translated."""
    kwargs = dict(kwargs)
    if "mixed_precision" in kwargs:
        mp = kwargs.pop("mixed_precision")
        if mp not in _ACCELERATE_PRECISION:
            raise ConfigError(f"mixed_precision={mp!r} is not valid; choose one of: no, bf16, fp16")
        kwargs.setdefault("precision", _ACCELERATE_PRECISION[mp])
    if "gradient_accumulation_steps" in kwargs:
        kwargs.setdefault("grad_accum_steps", kwargs.pop("gradient_accumulation_steps"))
    if "log_with" in kwargs:  # a name, a list of names or Accelerate's LoggerType members
        kwargs["log_with"] = check_log_with(kwargs["log_with"])
    if config is not None and kwargs:
        raise ConfigError("pass either config= or keywords to Engine(), not both")
    if config is not None:
        return config, []
    # the keywords alone first: a bad value is named as the code wrote it
    EngineConfig.of(**{k: v for k, v in kwargs.items() if k not in ("launch", "loss_scale")})
    return config_with_code(kwargs, config_source())


def _is_scheduler(obj: object) -> bool:
    return isinstance(obj, torch.optim.lr_scheduler.LRScheduler) or (
        hasattr(obj, "step") and isinstance(getattr(obj, "optimizer", None), torch.optim.Optimizer)
    )


def kind_of(obj: Any, session: Session | None) -> str:
    """What `prepare` makes of `obj`: "model", "optimizer", "dataloader", "scheduler" or "ema"
    (diffusers' EMAModel, `shardwise.weights.ema`); an object prepared already, or one of no such kind,
    is refused."""
    if isinstance(obj, nn.Module):
        if session is not None and session.is_prepared_model(obj):
            raise ValueError(f"{type(obj).__name__} was already prepared; prepare each model once")
        return "model"
    if isinstance(obj, PreparedOptimizer):
        raise ValueError("this optimizer was already prepared; prepare each optimizer once")  # noqa: TRY004
    if isinstance(obj, torch.optim.Optimizer):
        return "optimizer"
    if is_dataloader(obj):
        return "dataloader"
    if _is_scheduler(obj):
        return "scheduler"
    if is_ema(obj):
        return "ema"
    raise TypeError(
        f"prepare() cannot handle {type(obj).__module__}.{type(obj).__qualname__}; it takes "
        "torch.nn.Module, torch.optim.Optimizer, torch.utils.data.DataLoader, LR schedulers and "
        "diffusers' EMAModel"
    )


class LoaderTracker:
    """The prepared DataLoaders, the one that yielded the last batch (`active`) and whether that
    batch was its last (`at_end`): accumulation boundaries and `gather_for_metrics` read them.
    With `LoopRules.restore_outer_loader`, a loop that ends makes the loader active before it
    active again (`ended`)."""

    def __init__(self) -> None:
        self.loaders: list[PreparedDataLoader] = []
        self.active: PreparedDataLoader | None = None
        self.at_end = False
        self._outer: dict[int, tuple[PreparedDataLoader | None, bool]] = {}  # loader -> before its loop
        self._pass: tuple[int, int] | None = None  # the training pass the progress bar shows

    def reset(self) -> None:
        """Forget every loader (`Engine.free_memory`)."""
        self.loaders, self.active, self.at_end = [], None, False
        self._outer.clear()

    def on_batch(self, loader: PreparedDataLoader, last: bool, *, restore_outer: bool) -> None:
        if restore_outer and loader is not self.active:
            self._outer[id(loader)] = (self.active, self.at_end)
        self.active, self.at_end = loader, last

    def ended(self, loader: PreparedDataLoader) -> None:
        """A loop over `loader` ran to its end: the loader active before it is again, as in
        Accelerate's gradient_state (so a later gather is not cut to this loader's remainder)."""
        self.active, self.at_end = self._outer.pop(id(loader), (None, False))

    def new_pass(self) -> PreparedDataLoader | None:
        """The active loader when its current pass was not seen yet (then it is, from now on)."""
        loader = self.active
        if loader is None or (id(loader), loader.iteration) == self._pass:
            return None
        self._pass = (id(loader), loader.iteration)
        return loader

    def real_in_last_batch(self) -> int | None:
        """At the last batch of a loader that evened it out with repeated samples: how many of
        the gathered items are real (None: all are)."""
        loader = self.active
        if loader is None or not self.at_end or loader.remainder() == 0 or loader.tail == "uneven":
            return None
        return loader.remainder()


def checkpoint_parts(session: Session, loaders: list[PreparedDataLoader], registered: list[Any],
                     config: EngineConfig, rank: int, world: int) -> Any:
    """What `checkpoint.save` / `checkpoint.load` write and read for this engine."""
    from ..checkpoint.sharded import Parts

    owner = {id(p): i for i, m in enumerate(session.models) for p in m.parameters()}
    return Parts(
        models=session.models,
        unwrapped=[session.strategy.unwrap(m) for m in session.models],
        runners=[o.runner for o in session.optimizers],
        optimizer_models=[owner[id(o.runner.owner_params()[0])] for o in session.optimizers],
        loop_state={
            **session.step_state.state_dict(),  # "micro_step", "step"
            "grad_accum_steps": session.grad_accum_steps,
            "world_size": world,
            "scaler": session.strategy.precision.state_dict(),
            "schedulers": [s.state_dict() for s in session.schedulers],
            "loaders": [d.state_dict() for d in loaders],
            "registered": [o.state_dict() for o in registered],
        },
        strategy=session.strategy,
        info={k: getattr(config.sharding, k) for k in ("backend", "strategy", "offload", "precision")},
        rank=rank,
        world=world,
    )


def restore_loop_state(state: dict[str, Any], path: Path, session: Session, loaders: list[PreparedDataLoader],
                       registered: list[Any], world: int, *, loader_positions: bool) -> None:
    """Put a checkpoint's loop state back: schedulers, DataLoader positions (`loader_positions`
    False: each loader keeps its pass and epoch and starts the next pass from its beginning),
    registered objects, step counters and the loss scaler."""
    before = [(loader.iteration, loader.epoch) for loader in loaders]
    counts: dict[str, list[Any]] = {"schedulers": session.schedulers, "loaders": loaders,
                                     "registered": registered}
    for key, objs in counts.items():  # (their counts checked before the weights loaded)
        for obj, sd in zip(objs, state[key], strict=True):
            obj.load_state_dict(sd)
    if not loader_positions:
        for loader, (iteration, epoch) in zip(loaders, before):
            loader.forget_position(iteration, epoch)
    session.step_state.load_state_dict(state)
    saved_accum, saved_world = state.get("grad_accum_steps"), state.get("world_size")
    if (saved_accum, saved_world) != (None, None) and (saved_accum, saved_world) != (
            session.grad_accum_steps, world):
        if state["micro_step"] % (saved_accum or 1):
            raise CheckpointError(f"{path}: saved in the middle of an accumulation (micro-step "
                                  f"{state['micro_step']} of {saved_accum}); it resumes only with the same "
                                  "processes and grad_accum_steps")
        session.step_state.micro_step = 0  # saved on a boundary: the next micro-step starts one
    session.strategy.precision.load_state_dict(state["scaler"])
