"""Exponential moving averages of sharded models: diffusers' `EMAModel`, passed to `prepare`.

diffusers' EMAModel keeps one shadow tensor per parameter, updates it elementwise (`step`),
copies it in and out (`copy_to`, `store`, `restore`) and saves it as a model folder
(`save_pretrained`, from whole tensors). Built before `prepare`, as diffusers' scripts build it,
its shadows are whole tensors, and its first `step` on a sharded model's parameters (DTensors)
fails inside torch (`aten.sub.Tensor got mixed torch.Tensor and DTensor`).

Passed to `prepare` (`ema_model = accelerator.prepare(ema_model)`; Accelerate returns objects it
does not know unchanged, so the line runs under Accelerate as well), or built before `prepare`
and never passed to it, as diffusers' own scripts do (adopted at its first `step` on the sharded
parameters: `adopt_at_first_step`, which wraps diffusers' `EMAModel.step`), each shadow takes its
parameter's layout: the rows of this process's shard, cut locally (every process built the same
EMA from the same weights: no communication), so the EMA costs each process 1/W of the model and
`step`, `copy_to`, `store` and `restore` run on local shards. The Accelerator's save hooks call
`ema_model.save_pretrained(...)` on the main process alone: while they run, the shadows are
whole there (`whole_on_main`: one all-gather per shadow, every process joins). A load hook that
replaces them with whole tensors (`load_state_dict`) is cut back to shards after the hooks
(`shard`). Under a replicating strategy (ddp, zero1, DeepSpeed zero1/2) nothing changes.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..config.tree import ConfigError
from ..distributed.internals import shard_like


def is_ema(obj: Any) -> bool:
    """An EMA in diffusers' shape: a list of shadow tensors, `step` and `copy_to`."""
    return (isinstance(getattr(obj, "shadow_params", None), list) and callable(getattr(obj, "step", None))
            and callable(getattr(obj, "copy_to", None)))


@dataclass(slots=True)
class PreparedEMA:
    """An EMA and the prepared model's parameters its shadows follow, in its order."""

    ema: Any
    params: list[torch.Tensor]


def bind(ema: Any, models: Sequence[nn.Module]) -> PreparedEMA:
    """The prepared model whose parameters `ema`'s shadows follow (same number, same whole
    shapes, in order); one line naming the fix when there is none."""
    shadows = ema.shadow_params
    for model in models:
        params: list[torch.Tensor] = list(model.parameters())
        if any(hasattr(p, "ds_shape") for p in params):
            raise ConfigError(
                f"{type(ema).__name__}: the model is partitioned by DeepSpeed ZeRO-3, whose parameters are "
                "empty outside its forward; keep the EMA on backend='torch' (zero3 there shards it too), or "
                "use DeepSpeed's zero1/zero2")
        if len(params) == len(shadows) and all(tuple(s.shape) == tuple(p.shape)
                                               for s, p in zip(shadows, params)):
            return PreparedEMA(ema, params)
    raise ConfigError(
        f"{type(ema).__name__}: its {len(shadows)} shadow tensors match no prepared model's parameters; "
        "build it from the parameters of the model you train (EMAModel(model.parameters(), ...)) and "
        "prepare that model first, or in the same prepare() call")


# EMAs built before `prepare` and never passed to it (diffusers' scripts: `EMAModel(model.parameters())`,
# then `ema_model.step(model.parameters())` each step): diffusers' `EMAModel.step` is wrapped, once
# per process, and such an EMA is handed, at its first step on sharded parameters, to the engine
# that prepared them (`adopt_at_first_step`); module-level, as the class it wraps is
_ADOPTERS: list[weakref.WeakMethod[Callable[[Any, list[torch.Tensor]], bool]]] = []
_RECORDERS: list[weakref.WeakMethod[Callable[[Any, str, list[torch.Tensor]], None]]] = []
_WRAPPED: set[type] = set()


def adopt_at_first_step(adopt: Callable[[Any, list[torch.Tensor]], bool]) -> None:
    """Let `adopt(ema, params)` (an engine's bound method: it binds and shards the EMA if it
    prepared `params`, and says whether it did) take diffusers' EMAModel objects that reach their
    first `step` with whole shadows while the parameters they follow are shards. diffusers must
    be imported already (its scripts import EMAModel before `prepare`); nothing is imported here."""
    if not any(ref() == adopt for ref in _ADOPTERS):
        _ADOPTERS.append(weakref.WeakMethod(adopt))
    _wrap_diffusers()


def journal_calls(record: Callable[[Any, str, list[torch.Tensor]], None]) -> None:
    """`record(ema, method, params)` (an engine's bound method) hears every `store`, `copy_to`
    and `restore` of diffusers' EMAModel objects, before it runs (`engine.lone`: the main
    process's calls, replayed by the processes that serve its lone calls)."""
    if not any(ref() == record for ref in _RECORDERS):
        _RECORDERS.append(weakref.WeakMethod(record))
    _wrap_diffusers()


def _recorded(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def call(self: Any, parameters: Any) -> Any:
        params = list(parameters)
        for ref in list(_RECORDERS):
            fn = ref()
            if fn is not None:
                fn(self, name, params)
        return original(self, params)

    return call


def _wrap_diffusers() -> None:
    """diffusers' EMAModel, once per process: `step` adopts (`adopt_at_first_step`), `store`,
    `copy_to` and `restore` are heard (`journal_calls`)."""
    module = sys.modules.get("diffusers.training_utils")
    cls = getattr(module, "EMAModel", None)
    if cls is None or cls in _WRAPPED:
        return
    original = cls.step

    @functools.wraps(original)
    def step(self: Any, parameters: Any) -> Any:
        params = list(parameters)
        if (any(isinstance(p, DTensor) for p in params)
                and not any(isinstance(s, DTensor) for s in self.shadow_params)):
            for ref in list(_ADOPTERS):
                fn = ref()
                if fn is not None and fn(self, params):
                    break
        return original(self, params)

    cls.step = step
    for name in ("store", "copy_to", "restore"):
        setattr(cls, name, _recorded(name, getattr(cls, name)))
    _WRAPPED.add(cls)


def shard(prepared: PreparedEMA) -> None:
    """Each whole shadow cut to its parameter's layout (a DTensor parameter: this process's rows)."""
    ema = prepared.ema
    ema.shadow_params = [_like(s, p) for s, p in zip(ema.shadow_params, prepared.params)]


def _like(shadow: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    if not isinstance(param, DTensor) or isinstance(shadow, DTensor):
        return shadow
    # each process cuts its own copy (all hold the same values), kept beside the parameter's
    # shard (the host under offload params)
    return shard_like(shadow, param)


@contextlib.contextmanager
def whole_on_main(prepared: Sequence[PreparedEMA], is_main: bool) -> Iterator[None]:
    """Inside, every sharded EMA holds whole shadows on the main process (as diffusers' own
    `save_pretrained` needs); a collective: every process joins, one all-gather per shadow."""
    swapped: list[tuple[Any, list[torch.Tensor]]] = []
    for p in prepared:
        shadows = p.ema.shadow_params
        if not any(isinstance(s, DTensor) for s in shadows):
            continue
        whole = []
        for s in shadows:
            full = s.full_tensor() if isinstance(s, DTensor) else s
            whole.append(full if is_main else s)  # the others drop each at once
        swapped.append((p.ema, shadows))
        p.ema.shadow_params = whole
    try:
        yield
    finally:
        for ema, shadows in swapped:
            ema.shadow_params = shadows
