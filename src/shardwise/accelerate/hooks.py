"""What `Accelerator` needs for calls a script makes on one process alone, and Accelerate's
save/load pre-hooks.

Scripts written for Accelerate (diffusers' `train_unconditional.py`) call `save_state()` and
sample with the model inside `if accelerator.is_main_process:`. Whether every process made the
call is told without a collective (`shardwise.distributed.arrival`).

A lone save under ddp (every process holds the whole state) is written as a checkpoint of a
world of one: the weights, optimizer, schedulers, loop state and registered objects as this
process holds them, and only this process's generator states. `load_state` on every process
reads it (resharding from one process); the processes it has no generator state for keep
their own, as Accelerate's resume does when `random_states_<i>.pkl` is missing.
"""

from __future__ import annotations

import contextlib
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..distributed.arrival import alone, arrived_together
from ..engine import Engine


def save_together(calls: dict[int, int], step: int, world: int, rank: int, wait_s: float,
                  sharded_as: str | None, moved_on: Callable[[], bool]) -> bool:
    """False when the main process alone called save_state; refused at once when the state is
    sharded (`sharded_as` names the layout), since the other processes hold part of it."""
    if arrived_together(calls, "save", step, world, rank == 0, wait_s, moved_on):
        return True
    if sharded_as is not None:
        raise RuntimeError(
            f"save_state() was called on process {rank} alone (e.g. inside `if accelerator."
            f"is_main_process:`), but under {sharded_as} each process holds a shard of the state: call "
            "save_state() on every process")
    return False


@contextlib.contextmanager
def world_of_one(engine: Engine) -> Iterator[None]:
    """Inside, `engine` is process 0 of one and its checkpoint code runs no collective
    (`distributed.arrival.alone`): a lone process writes a complete single-process checkpoint.
    Only for replicated state (ddp); the process group itself is untouched."""
    with engine.as_world_of_one(), alone(), warnings.catch_warnings():
        # DCP's "assuming the intent is to save in a single process": it is
        warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
        yield


class StateHooks:
    """Accelerate's `register_save_state_pre_hook` / `register_load_state_pre_hook` registries.

    A save hook is called as `hook(models, weights, output_dir)` with the models as Accelerate
    keeps them (unwrapped from DDP; a sharded model as it is, whose own `save_pretrained` then
    writes the whole weights on the main process alone too) and each one's state dict (a
    sharded model's gathered: whole on the main process, {} on the others), once the checkpoint
    is in place (Accelerate: before it writes; but a
    shardwise checkpoint is staged and renamed into a folder that must hold nothing else, so the
    hook's files join it after); a load hook as `hook(models, input_dir)`, before anything is
    read. (In Accelerate, popping from `weights` / `models` means "the hook saved / loaded this
    model itself". shardwise's checkpoint keeps every model's weights
    whatever the hook popped, since the optimizer state is stored against them, and loads them
    back after the load hooks: the same weights the hook saved at the same moment.)
    """

    def __init__(self) -> None:
        # OrderedDict: RemovableHandle keeps a weak reference to its table, which a dict cannot take
        self.save: OrderedDict[int, Callable[..., None]] = OrderedDict()
        self.load: OrderedDict[int, Callable[..., None]] = OrderedDict()

    @staticmethod
    def add(table: dict[int, Callable[..., None]], hook: Callable[..., None]) -> RemovableHandle:
        handle = RemovableHandle(table)
        table[handle.id] = hook
        return handle

    def after_save(self, models: list[nn.Module], weights: list[dict[str, Any]], output_dir: str) -> None:
        for hook in list(self.save.values()):
            hook(list(models), list(weights), output_dir)

    def before_load(self, models: list[nn.Module], input_dir: str) -> None:
        for hook in list(self.load.values()):
            hook(list(models), input_dir)


class SoloForwardCheck:
    """On a sharded model, called by the engine's forward hook: a forward run without autograd
    (sampling, evaluation) that no `wait_for_everyone()` rendezvous settled (`engine.lone`: after
    one, the others serve the main process's lone forwards) first checks that every process is
    in it, since its parameter all-gathers need them all; alone, it refuses in one line instead
    of waiting in the all-gather forever. Training forwards (autograd on) run in lockstep by
    construction and never come here."""

    def __init__(self, world: int, is_main: bool, wait_s: float, step: Callable[[], int],
                 moved_on: Callable[[], bool], noun: str) -> None:
        self.world, self.is_main, self.wait_s, self.noun = world, is_main, wait_s, noun
        self.step, self.moved_on = step, moved_on
        self.calls: dict[int, int] = {}

    def __call__(self, module: nn.Module, args: Any) -> None:
        if torch.is_grad_enabled() or self.world == 1:
            return
        if not arrived_together(self.calls, "forward", self.step(), self.world, self.is_main, self.wait_s,
                                self.moved_on):
            raise RuntimeError(
                f"a forward of the sharded {self.noun} ran on one process "
                "alone: its parameters are sharded across processes and gathered by all of them; call "
                "accelerator.wait_for_everyone() on every process first (the others then run its forwards "
                "with it), run it on every process, or use a full "
                "copy: `state = accelerator.get_state_dict(model)` on every process, then load it into an "
                "unsharded model")
